"""The deterministic "model".

The KV state of a prompt is a chain of block contents: block ``k`` of the prompt holds
``H(content[k-1] || token ids of block k)`` (SHA-256, the root parent is :data:`ROOT_HASH`), the
last (possibly partial) block included. This is also the block hash used by the prefix cache
and the KV events, as in vLLM.

Output token ``i`` is a function of (the content of the block holding the *last prompt token*,
as it sits in this server's KV memory; the prompt length; ``i``; the model seed). So:

* colocated: the server computed the chain itself -> the "right" answer;
* P/D with an intact transfer: the decode holds the same bytes -> identical tokens;
* truncated, stale, foreign or corrupted KV: the decode holds other bytes -> other tokens,
  with HTTP 200, exactly the silent failure of real engines.

Greedy decoding (``temperature`` unset or 0) depends only on that. Sampling (``temperature > 0``)
mixes in the request's ``seed`` when given, else a random one per request.

Every emitted token is a printable ASCII byte (mostly lowercase letters and spaces), so output
text detokenizes cleanly and ``len(text) == completion_tokens``.
"""

from __future__ import annotations

import hashlib
import struct

from emulator.tokenizer import BYTE_OFFSET

ROOT_HASH = hashlib.sha256(b"pd-gateway-emulator-none-hash").digest()
_ALPHABET = "etaoinshrdlucmfwypvbgkqjxz" + "etaoinshrdlu" + "      " + ",."
ALPHABET_IDS: tuple[int, ...] = tuple(ord(c) + BYTE_OFFSET for c in _ALPHABET)
_MASK = (1 << 64) - 1
_MUL = 6364136223846793005
_INC = 1442695040888963407


def _pack(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}I", *ids)


def chain_hashes(ids: list[int], block_size: int) -> list[bytes]:
    """Per-block chained hashes of a prompt, the last partial block included."""
    out: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(ids), block_size):
        parent = hashlib.sha256(parent + _pack(ids[start : start + block_size])).digest()
        out.append(parent)
    return out


def num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def hash_to_int(h: bytes) -> int:
    """The low 64 bits of a block hash as an unsigned int (vLLM's int form; SGLang's format)."""
    return int.from_bytes(h[-8:], "big")


def stream_state(kv_last_block: bytes, prompt_len: int, model_seed: int, sample_seed: int | None) -> int:
    """The generator state for a request: everything its output depends on."""
    base = int.from_bytes(kv_last_block[:8], "little") ^ (prompt_len * 0x9E3779B97F4A7C15)
    base ^= (model_seed * 0xBF58476D1CE4E5B9) & _MASK
    if sample_seed is not None:
        base ^= ((sample_seed + 1) * 0x94D049BB133111EB) & _MASK
    return base & _MASK


def next_state(state: int) -> int:
    return (state * _MUL + _INC) & _MASK


def token_from_state(state: int) -> int:
    return ALPHABET_IDS[(state >> 33) % len(ALPHABET_IDS)]


def logprob_from_state(state: int) -> float:
    return -0.05 - ((state >> 20) & 0xFFFF) / 16384.0


def generate(state: int, n: int) -> list[int]:
    """``n`` tokens from a state (the zero-delay fast path; same sequence as stepping)."""
    out = []
    mul, inc, mask, table, size = _MUL, _INC, _MASK, ALPHABET_IDS, len(ALPHABET_IDS)
    for _ in range(n):
        state = (state * mul + inc) & mask
        out.append(table[(state >> 33) % size])
    return out


def states(state: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        state = next_state(state)
        out.append(state)
    return out


def prompt_logprob(prev_id: int, token_id: int) -> float:
    x = ((prev_id * 1000003) ^ (token_id * 7919)) & 0xFFFF
    return -0.5 - x / 8192.0


def tie_gap(prev_id: int, token_id: int) -> float | None:
    """How far (nats) the runner-up trails the best token `token_id` after `prev_id` where the
    two are near-tied (about one pair in eight), None elsewhere (it trails by 0.25, as each
    further rank trails the one before). Two engines' passes over the same prompt that differ in
    their last bits (batch, kernel) may draw either of near-tied tokens."""
    x = ((prev_id * 2654435761) ^ (token_id * 40503)) & 0xFFFF
    return 0.02 if x % 8 == 0 else None


def runner_up(token_id: int) -> int:
    """The second most likely token where `token_id` is the best (the `logprobs` alternatives'
    first)."""
    return next(t for t in ALPHABET_IDS if t != token_id)


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of an ``n > 1`` request (vLLM's child requests use
    ``seed + index``): greedy stays greedy, sampled children differ yet are reproducible. Kept
    inside int64, wrapping past its top as a gateway that splits the samples must (an engine
    takes no seed outside it)."""
    return None if seed is None else (seed + index + 2**63) % 2**64 - 2**63
