"""What the routing tokenizer (gateway/routing_tokenizer.py) costs a request: the ids of a
20,000-token text prompt, and the engine block keys the precise index hashes from them.

    python -m bench.replay.tokenize_cost      (timed: run it under the benchmark lock)

Prints microseconds per request, the best of five repeats:

  * `emulator` ids: the emulator kind's ids (bytes, one per UTF-8 byte, BOS first);
  * engine keys, cold / warm: all 1,250 blocks of 16 tokens hashed the emulator's way (SHA-256
    chained), with an empty memo (every block hashed) and with the blocks remembered (a prefix
    seen before: a dict lookup per block). A lookup hashes only the blocks it probes, about
    twice its match's depth (policies/block_index.py), so these are the worst case;
  * `hf` ids: a byte-level BPE `tokenizer.json` (GPT-2 / Llama-3 style pre-tokenizer, 600
    tokens, trained here on English words: the shape of a real one, not its vocabulary) on a
    text of English words that it encodes to 20,000 tokens;
  * the event loop's longest stall while that prompt is tokenized five times, inline (`encode`,
    the GIL held throughout) and as the gateway does it for a long prompt (`encode_batch` in a
    worker thread, the GIL released: gateway/routing_tokenizer.py `offload_bytes`), beside a
    task that sleeps 1 ms at a time (milliseconds beyond its sleep).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path

from adapters.blockhash import HashSpec, make_hasher
from bench.loop_watch import LoopWatch
from bench.replay import prompts
from gateway.routing_tokenizer import EmulatorTokenizer, HfTokenizer
from policies.prompt_key import PromptKey

TOKENS = 20_000


def best_us(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def bpe_file(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"], show_progress=False)
    words = prompts.CANDIDATE_WORDS
    tok.train_from_iterator([" ".join(words[i:] + words[:i]) for i in range(40)] * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(path))
    return path


def main() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(TOKENS - 1)).encode()
    emu = EmulatorTokenizer()
    ids = emu.text_ids(text)
    assert len(ids) == TOKENS
    print(f"emulator ids, {TOKENS} tokens: {best_us(lambda: emu.text_ids(text), 1000):.1f} us")

    def keys(hasher: object) -> None:
        PromptKey("text", text, len(text), ids).engine_keys(hasher, TOKENS)  # type: ignore[arg-type]

    warm = make_hasher(HashSpec(scheme="emulator", block_size=16))
    keys(warm)
    cold = best_us(lambda: keys(make_hasher(HashSpec(scheme="emulator", block_size=16))), 10)
    print(
        f"engine keys, {TOKENS // 16} blocks: cold {cold:.0f} us, warm {best_us(lambda: keys(warm), 20):.0f} us"
    )
    with tempfile.TemporaryDirectory() as d:
        hf = HfTokenizer(str(bpe_file(Path(d) / "tokenizer.json")))
    words = [rng.choice(prompts.CANDIDATE_WORDS) for _ in range(TOKENS)]
    lo, hi = 1, len(words)  # the most words that encode to at most TOKENS tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(hf.text_ids(" ".join(words[:mid]).encode())) <= TOKENS:
            lo = mid
        else:
            hi = mid - 1
    data = " ".join(words[:lo]).encode()
    n = len(hf.text_ids(data))
    print(f"hf ids, {n} tokens ({len(data)} bytes): {best_us(lambda: hf.text_ids(data), 10):.0f} us")
    assert list(hf.text_ids_unlocked(data)) == list(hf.text_ids(data))
    for threaded in (False, True):
        stall = asyncio.run(loop_stall(hf, data, threaded))
        print(f"hf ids, {'worker thread' if threaded else 'inline'}: the loop's longest stall {stall:.1f} ms")


async def loop_stall(hf: HfTokenizer, data: bytes, threaded: bool) -> float:
    """The longest delay (ms) past a 1 ms sleep while `data` is tokenized five times."""
    loop = asyncio.get_running_loop()
    async with LoopWatch(0.001) as watch:
        await asyncio.sleep(0.02)
        for _ in range(5):
            if threaded:
                await loop.run_in_executor(None, hf.text_ids_unlocked, data)
            else:
                hf.text_ids(data)
            await asyncio.sleep(0.005)
    return watch.late_s * 1e3


if __name__ == "__main__":
    main()
