"""What a request's prompt is, for prefix matching: token ids where the request has them, else
its text rendered canonically.

A `PromptKey` is made once per request by the request path (`from_token_ids`, `from_text`,
`from_chat`) and read by the cache-aware policy through `RequestView.prompt_key`. It turns the
prompt into chains of block keys:

- `approx_chain(block_units)`: the gateway's own chain (block `j`'s key identifies blocks
  `0..j` of the prompt), for the approximate index of what the gateway sent where. Token ids
  and text are keyed in separate domains: the ids `[72, 105]` and the text "Hi" never share
  a key, and a chat and a completion with the same words do not either (their role markers
  differ, as the engine's tokens do).
- `engine_keys(hasher, upto)`: the engine's own block hashes (`BlockHasher`, implemented by
  `adapters.blockhash` for each engine), for the index built from the engines' KV events.
  Only prompts with token ids have them: given as ids, or a text prompt with the ids of the
  gateway's routing tokenizer (gateway/routing_tokenizer.py; the key stays a text key for the
  approximate index); computed lazily, block by block, as far as a lookup asks, and remembered.

Chat messages are rendered so that a conversation's turns share a prefix: turn `k + 1`'s
rendering starts with turn `k`'s. Each message is its role, name, text content, tool calls
and tool call id between separator bytes; a non-text content part (an image, audio, a file) is
its type and a digest of its canonical JSON, so two different images never look alike and the
same image always does. `tools` come first (templates render them before the messages).

Keys only depend on the prompt: no session id, user or request id (an id that merely looks
like another, "session-1" and "session-12", shares nothing).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import msgspec

_json = msgspec.json.Encoder(order="sorted")

# separators that never occur in text a client sends in practice (ASCII control characters)
_MSG = "\x1e"  # record separator: a new message
_FIELD = "\x1f"  # unit separator: role / name / tool call id
_PART = "\x1c"  # file separator: a non-text part or the tool calls
_TOOLS = "\x1d"  # group separator: the tools block

Kind = Literal["tokens", "text"]


class BlockHasher(Protocol):
    """An engine's block hash, as its KV events publish it (`adapters.blockhash`)."""

    @property
    def key(self) -> str:
        """Identifies the scheme (engine, algorithm, seed, block size): the memo key."""
        ...

    @property
    def block_size(self) -> int: ...

    def extend(self, token_ids: Sequence[int], keys: list[int], state: object, upto: int) -> object:
        """Append the index keys of full blocks `len(keys) .. upto - 1` to `keys`; `state` is
        the chain's state after `len(keys)` blocks (None before the first) and the new state
        is returned."""
        ...


class PromptKey:
    """A prompt for prefix matching. Read-only once made; its chains are computed on demand
    and remembered (the same answer every time: a pure function of the prompt)."""

    __slots__ = ("_approx", "_engine", "data", "kind", "token_ids", "units")

    def __init__(self, kind: Kind, data: bytes, units: int, token_ids: Sequence[int] | None) -> None:
        self.kind: Kind = kind
        self.data = data  # ids as little-endian int64, or the canonical UTF-8 text
        self.units = units  # tokens, or bytes of text
        self.token_ids = token_ids  # a text prompt's: the routing tokenizer's, where there is one
        self._approx: dict[int, tuple[int, ...]] = {}
        self._engine: dict[str, tuple[list[int], object]] = {}

    def __repr__(self) -> str:
        return f"PromptKey({self.kind}, {self.units} {'tokens' if self.kind == 'tokens' else 'bytes'})"

    # -- construction -----------------------------------------------------------------------

    @classmethod
    def from_token_ids(cls, ids: Sequence[int]) -> PromptKey | None:
        """A prompt given as token ids; None when an id is not a 64-bit integer."""
        try:
            data = struct.pack(f"<{len(ids)}q", *ids)
        except (struct.error, TypeError):
            return None
        return cls("tokens", data, len(ids), tuple(ids))

    @classmethod
    def from_text(cls, text: str) -> PromptKey:
        data = text.encode("utf-8", "surrogatepass")
        return cls("text", data, len(data), None)

    @classmethod
    def from_chat(cls, messages: Sequence[Any], tools: Any = None) -> PromptKey | None:
        """Chat messages (decoded JSON: a list of objects) rendered canonically; None when
        they are not a list of objects."""
        text = render_chat(messages, tools)
        return None if text is None else cls.from_text(text)

    # -- chains -------------------------------------------------------------------------------

    def block_bytes(self, block_units: int) -> int:
        return block_units * 8 if self.kind == "tokens" else block_units

    def full_blocks(self, block_units: int) -> int:
        return self.units // block_units

    def approx_chain(self, block_units: int) -> tuple[int, ...]:
        """The gateway's chained keys of the prompt's full blocks of `block_units` tokens (token
        ids) or bytes (text). Python's hash: fast, and fine for an index that lives in this
        process; a collision only costs a routing choice."""
        got = self._approx.get(block_units)
        if got is not None:
            return got
        step = self.block_bytes(block_units)
        data = self.data
        h = hash((self.kind, block_units))  # the domain: tokens and text never share a key
        out: list[int] = []
        append = out.append
        for start in range(0, len(data) - step + 1, step):
            h = hash((h, data[start : start + step]))
            append(h)
        chain = tuple(out)
        self._approx[block_units] = chain
        return chain

    def engine_keys(self, hasher: BlockHasher, upto: int) -> list[int]:
        """The engine's block keys of (at least) the first `upto` full blocks, fewer when the
        prompt is shorter; empty without token ids. The list is the memo: do not modify it."""
        ids = self.token_ids
        if ids is None:
            return []
        upto = min(upto, len(ids) // hasher.block_size)
        memo = self._engine.get(hasher.key)
        if memo is None:
            memo = self._engine[hasher.key] = ([], None)
        keys, state = memo
        if len(keys) < upto:
            state = hasher.extend(ids, keys, state, upto)
            self._engine[hasher.key] = (keys, state)
        return keys

    def engine_chain(self, hasher: BlockHasher, max_blocks: int | None = None) -> EngineChain:
        """The engine's keys as a sequence computed only as far as it is read."""
        n = 0 if self.token_ids is None else len(self.token_ids) // hasher.block_size
        return EngineChain(self, hasher, n if max_blocks is None else max(0, min(n, max_blocks)))


class EngineChain(Sequence[int]):
    """A prompt's engine block keys, hashed on first access (a lookup reads O(log n) of them)."""

    __slots__ = ("_hasher", "_key", "_keys", "_n")

    def __init__(self, key: PromptKey, hasher: BlockHasher, n: int) -> None:
        self._key = key
        self._hasher = hasher
        self._n = n
        self._keys = key.engine_keys(hasher, 0)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        keys = self._keys
        if i >= len(keys):
            keys = self._keys = self._key.engine_keys(self._hasher, i + 1)
        return keys[i]


def _content_text(content: Any, out: list[str]) -> bool:
    if content is None:
        return True
    if isinstance(content, str):
        out.append(content)
        return True
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping):
                return False
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                digest = hashlib.blake2b(_json.encode(part), digest_size=16).hexdigest()
                out.append(f"{_PART}{part.get('type')}:{digest}{_PART}")
        return True
    return False


def render_chat(messages: Sequence[Any], tools: Any = None) -> str | None:
    """The canonical text of chat messages (see the module docstring); None if malformed."""
    if not isinstance(messages, list):
        return None
    out: list[str] = []
    if tools:
        out.append(_TOOLS + _json.encode(tools).decode() + _TOOLS)
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        out.append(f"{_MSG}{m.get('role')}")
        name = m.get("name")
        if name is not None:
            out.append(f"{_FIELD}{name}")
        out.append(_FIELD)
        if not _content_text(m.get("content"), out):
            return None
        reasoning = m.get("reasoning_content")
        if isinstance(reasoning, str):
            out.append(f"{_PART}reasoning{_PART}{reasoning}")
        calls = m.get("tool_calls")
        if calls:
            out.append(_PART + _json.encode(calls).decode())
        call_id = m.get("tool_call_id")
        if call_id is not None:
            out.append(f"{_FIELD}{call_id}")
    return "".join(out)
