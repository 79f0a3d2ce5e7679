"""A streamed request split into units (`n > 1` or a batch on SGLang P/D, gateway/samples.py) in
which an engine refuses one unit for the request's own fault is that refusal, as when it is not
streamed: no other unit's tokens before it, whichever leg answers first. A direct SGLang server
checks every prompt before it streams any (its batch's prompts are tokenized and validated first,
and its OpenAI routes await the first chunk before the 200). The merged stream starts once every
unit of the first wave is past its engines' refusals; before that, units' events are held.

Found as a race: a prompt at the prefill's `max_req_input_len` but within the context is refused
by the prefill alone (its decode would wait for KV, sglang #30233), so the gateway gives the decode
0.25 s to refuse too; meanwhile the other prompts' tokens reached the client, and the stream ended
with an error event. Real sockets, emulated SGLang prefill and decode."""

from __future__ import annotations

import json
from typing import Any

import pytest

from emulator.api import EmulatorSpec, start_emulator
from gateway.config import LimitsConfig
from tests.faults.sglang_pd import sglang_pd
from tests.integration.test_gateway import post, sse_events

CTX = 256  # max_req_input_len: CTX - 1 - 5 = 250
BAND = "y" * 249  # 250 tokens (with BOS): the prefill's scheduler refuses it, its decode does not
OVER = "z" * 300  # 301 tokens: over the context, the tokenizer of both legs refuses it
PROMPTS = ["The quick brown fox", "Lorem ipsum dolor"]


def spec(role: str, faults: tuple[str, ...] = (), seed: int = 0) -> EmulatorSpec:
    return EmulatorSpec(
        engine="sglang",
        role=role,  # type: ignore[arg-type]
        model="m",
        time_scale=0.05,
        max_model_len=CTX,
        faults=list(faults),
        seed=seed,
    )


def batch(route: str, prompts: list[str], stream: bool) -> dict[str, Any]:
    if route == "/generate":
        return {"text": prompts, "stream": stream, "sampling_params": {"max_new_tokens": 4}}
    return {"model": "m", "prompt": prompts, "max_tokens": 4, "stream": stream}


def refusal(raw: bytes) -> str:
    """The refusal's message: an error body, or a stream's error or abort event (a direct
    server's forms)."""
    if not raw.lstrip().startswith(b"data:"):
        err = json.loads(raw)
        return str(err["error"]["message"] if "error" in err else err["message"])
    for ev in sse_events(raw):
        if isinstance(ev, dict) and "error" in ev:
            return str(ev["error"]["message"])
        fin = ev.get("meta_info", {}).get("finish_reason") if isinstance(ev, dict) else None
        if isinstance(fin, dict) and fin.get("type") == "abort":
            return str(fin["message"])
    raise AssertionError(raw)


@pytest.mark.parametrize("prompt", [BAND, OVER], ids=["prefill_refuses", "both_refuse"])
@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_a_streamed_batch_with_a_refused_prompt_is_the_refusal_alone(route: str, prompt: str) -> None:
    prompts = [PROMPTS[0], prompt, PROMPTS[1]]
    direct = await start_emulator(spec("both"))
    try:
        async with sglang_pd([spec("prefill")], spec("decode")) as c:
            ws, _, whole = await post(c.url + route, batch(route, prompts, False))
            for _ in range(3):
                s, headers, raw = await post(c.url + route, batch(route, prompts, True))
                # the whole answer's status and body: nothing streamed, no other prompt's tokens
                assert (s, raw) == (ws, whole) == (400, whole), raw[:600]
                assert headers["content-type"] == "application/json"
            # in the words a direct server refuses the same batch with
            _, _, ref = await post(direct.url + route, batch(route, prompts, True))
            assert refusal(raw) == refusal(ref), (raw, ref[:600])
    finally:
        await direct.stop()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_streamed_n_gt_1_chat_with_one_sample_refused_is_the_refusal_alone(leg: str) -> None:
    """One sample of three refused by an injected engine 400: by the prefill (whose decode then
    gets 0.25 s to agree, while the other samples stream) or by the decode at its headers. The
    fault's seeded draws refuse exactly one of the first three requests, and one of the next
    three."""
    fault = ("http_error:0.2,status=400,message=refused by the engine",)
    p = spec("prefill", fault if leg == "prefill" else (), seed=6)
    d = spec("decode", fault if leg == "decode" else (), seed=6)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "n": 3,
        "max_tokens": 6,
        "stream": True,
    }
    async with sglang_pd([p], d) as c:
        s, headers, raw = await post(c.url + "/v1/chat/completions", body)
        ws, _, whole = await post(c.url + "/v1/chat/completions", body | {"stream": False})
        assert (s, raw) == (ws, whole), raw[:600]
        assert s == 400 and json.loads(raw)["error"]["message"] == "refused by the engine", raw[:600]
        assert headers["content-type"] == "application/json"
        # the next request has no fault left to draw for a while: served, merged, [DONE]
        s, _, raw = await post(c.url + "/v1/chat/completions", body)
        events = sse_events(raw)
        assert s == 200 and events[-1] == "[DONE]", raw[-600:]
        assert {ch["index"] for ev in events[:-1] for ch in ev["choices"]} == {0, 1, 2}


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_a_unit_started_after_the_first_wave_is_refused_mid_stream(route: str) -> None:
    """Past `split_concurrency`, a unit starts only when an earlier one ends: the stream may
    already carry tokens, and a refusal then ends it with an error event and no [DONE]."""
    async with sglang_pd([spec("prefill")], spec("decode"), limits=LimitsConfig(split_concurrency=1)) as c:
        s, _, raw = await post(c.url + route, batch(route, [PROMPTS[0], BAND], True))
        events = sse_events(raw)
        assert s == 200 and events[-1] != "[DONE]", raw[-600:]
        assert "exceeds the maximum allowed length" in events[-1]["error"]["message"], events[-1]
        first = events[0]
        assert (first["index"] if route == "/generate" else first["choices"][0]["index"]) == 0
