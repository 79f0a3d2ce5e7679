"""A minimum length (vLLM's `min_tokens`, SGLang's `min_new_tokens`) masks the stop token ids
while the output is shorter than it, as both engines do (vLLM's MinTokensLogitsProcessor sets
their logits to -inf; SGLang's min-new-tokens penalizer): a stop id the model would draw there
is never drawn, the most likely token left comes instead, and the output never shows a stop id
before the minimum. After it, a stop id ends the sequence. The emulated model ranks its
alphabet after its chosen token, so the token drawn instead is the alphabet's first one not
masked; the tokens after it stay the model's own."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from emulator.model import ALPHABET_IDS
from emulator.tokenizer import BYTE_OFFSET
from tests.emulator.conftest import Factory, drawn_instead, sse_events

PROMPT = "Hello world, the quick brown fox"
ALPHABET = "".join(chr(t - BYTE_OFFSET) for t in ALPHABET_IDS)
MIN = 20


async def answer(
    http: aiohttp.ClientSession, engine: str, url: str, params: dict[str, Any], stream: bool
) -> tuple[str, str | None, Any]:
    """(text, finish reason, the stop id or string that ended it) of one request: vLLM's
    completions, SGLang's /generate (`params` in the engine's own names)."""
    if engine == "vllm":
        body = {"prompt": PROMPT, **params, "stream": stream}
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            raw = await r.text()
        if not stream:
            c = json.loads(raw)["choices"][0]
            return c["text"], c["finish_reason"], c["stop_reason"]
        chunks = [json.loads(e)["choices"][0] for e in sse_events(raw) if e != "[DONE]"]
        last = [c for c in chunks if c["finish_reason"]][-1]
        return "".join(c["text"] for c in chunks), last["finish_reason"], last["stop_reason"]
    body = {"text": PROMPT, "sampling_params": params, "stream": stream}
    async with http.post(url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.text()
    obj = json.loads(sse_events(raw)[-2]) if stream else json.loads(raw)  # (the last is [DONE])
    fin = obj["meta_info"]["finish_reason"]
    return obj["text"], fin["type"], fin.get("matched")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
async def test_a_stop_id_is_never_drawn_before_min_tokens_and_ends_the_output_after(
    emu: Factory, http: aiohttp.ClientSession, engine: str, sampling: str, stream: bool
) -> None:
    s = await emu(engine, "both")
    vllm = engine == "vllm"
    params: dict[str, Any] = {"max_tokens" if vllm else "max_new_tokens": 120, "temperature": 0}
    if sampling == "seeded":
        params |= {"temperature": 0.9, "seed" if vllm else "sampling_seed": 11}
    full, finish, _ = await answer(http, engine, s.url, params, False)
    assert finish == "length" and len(full) == 120
    head = full[:MIN]
    # the characters the model draws most often before MIN, and the alphabet's first two (so
    # that the token drawn instead is further down it)
    common = sorted(set(head), key=lambda c: (-head.count(c), c))[:3]
    masked = {*common, ALPHABET[0], ALPHABET[1]}
    instead = drawn_instead(masked)
    ids = sorted(ord(c) + BYTE_OFFSET for c in masked)
    params |= {"stop_token_ids": ids, "min_tokens" if vllm else "min_new_tokens": MIN}
    rest = full[MIN:]
    at = next(i for i, c in enumerate(rest) if c in masked)  # (the model's output has one)
    want = "".join(instead if c in masked else c for c in head) + rest[:at]
    assert any(c in masked for c in head)  # without the minimum, a stop id would end it early
    text, finish, matched = await answer(http, engine, s.url, params, stream)
    assert not masked & set(text), text
    assert (text, finish, matched) == (want, "stop", ord(rest[at]) + BYTE_OFFSET)
    # a minimum as long as the whole answer: no stop id at all, the length ends it
    params |= {"min_tokens" if vllm else "min_new_tokens": 120}
    text, finish, _ = await answer(http, engine, s.url, params, stream)
    assert (text, finish) == ("".join(instead if c in masked else c for c in full), "length")


async def test_a_mask_over_the_whole_alphabet_draws_another_printable_token(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    s = await emu("vllm", "both")
    ids = sorted({*ALPHABET_IDS})
    params = {"max_tokens": 8, "temperature": 0, "stop_token_ids": ids, "min_tokens": 8}
    text, finish, _ = await answer(http, "vllm", s.url, params, False)
    first_free = next(chr(b) for b in range(32, 127) if ord(chr(b)) + BYTE_OFFSET not in ids)
    assert (text, finish) == (first_free * 8, "length")
