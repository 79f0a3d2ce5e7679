"""Requests whose answer needs the prompt computed where it is answered: `echo` with `logprobs`
and vLLM's `prompt_logprobs` (the prompt's logprobs), `echo` with `max_tokens` 0 (the prompt
alone). A P/D decode is handed the prompt's KV instead of computing it: vLLM's decode then
ignores the KV and computes the prompt again (the prefill's work is wasted), and SGLang's
decode answers echo + logprobs > 0 without the prompt's logprobs. So the gateway serves them on
vLLM's decode alone, sends SGLang's echo + logprobs > 0 to a colocated worker or refuses it with
a clear 400 where only an SGLang pair could serve it, and lets through SGLang's pair what SGLang
itself ignores or refuses. Plain `echo` goes through P/D and equals the colocated answer."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.integration.conftest import Cluster, build_cluster, stop_cluster
from tests.integration.test_gateway import generated, post, sse_events

PROMPT = "The capital of France is"


def plans(c: Cluster, model: str) -> dict[str, float]:
    """pdgw_requests_total for `model` on /v1/completions, by plan (outcome ok)."""
    out: dict[str, float] = {}
    for line in c.gateway.metrics.render().decode().splitlines():
        if not line.startswith("pdgw_requests_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        if labels.get("model") == model and labels.get("outcome") == "ok":
            out[labels["plan"]] = out.get(labels["plan"], 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def grew(before: dict[str, float], after: dict[str, float]) -> set[str]:
    return {p for p, v in after.items() if v > before.get(p, 0.0)}


def answer(raw: bytes, stream: bool) -> tuple[str, list[Any], Any]:
    """Choice 0's text, its (token, logprob) pairs and its prompt_logprobs (streams joined)."""
    objs = [json.loads(raw)] if not stream else [e for e in sse_events(raw) if e != "[DONE]"]
    text, pairs, prompt_lps = "", [], None
    for o in objs:
        for ch in o.get("choices", []):
            if ch.get("index", 0) != 0:
                continue
            text += ch.get("text") or ""
            lp = ch.get("logprobs")
            if lp:
                pairs += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
            if ch.get("prompt_logprobs") is not None:
                prompt_lps = ch["prompt_logprobs"]
    return text, pairs, prompt_lps


def completion(model: str, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": stream, **extra}


@pytest.fixture
async def both() -> Any:
    """The standard cluster plus a colocated worker for each P/D model."""
    c = await build_cluster(colocated_fallback=True)
    try:
        yield c
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_plain_echo_goes_through_pd_and_equals_colocated(
    cluster: Cluster, model: str, stream: bool
) -> None:
    body = completion(model, stream, echo=True)
    before = plans(cluster, model)
    s, _, raw = await post(cluster.url + "/v1/completions", body)
    assert s == 200, raw
    assert grew(before, plans(cluster, model)) == {"disaggregated"}
    _, _, ref = await post(cluster.reference[model].url + "/v1/completions", body)
    got, want = answer(raw, stream), answer(ref, stream)
    assert got == want and got[0].startswith(PROMPT) and len(got[0]) > len(PROMPT)


SCORING = [
    pytest.param({"echo": True, "logprobs": 1}, id="echo+logprobs"),
    pytest.param({"echo": True, "logprobs": 0}, id="echo+logprobs0"),
    pytest.param({"prompt_logprobs": 1}, id="prompt_logprobs"),
    pytest.param({"echo": True, "max_tokens": 0}, id="echo+max_tokens0"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("extra", SCORING)
async def test_vllm_prompt_scoring_is_served_by_the_decode_alone(
    cluster: Cluster, extra: dict[str, Any], stream: bool
) -> None:
    """vLLM scores the prompt for all of these (`logprobs` 0 included): its decode serves them."""
    body = completion("m-vllm", stream, **extra)
    before = plans(cluster, "m-vllm")
    s, _, raw = await post(cluster.url + "/v1/completions", body)
    rs, _, ref = await post(cluster.reference["m-vllm"].url + "/v1/completions", body)
    if "prompt_logprobs" in extra and stream:  # vLLM refuses it on streams: the engine's 400
        assert s == rs == 400 and json.loads(raw)["error"]["param"] == "prompt_logprobs", raw
        return
    assert s == 200, raw
    assert grew(before, plans(cluster, "m-vllm")) == {"decode_self_prefill"}
    got, want = answer(raw, stream), answer(ref, stream)
    assert got == want
    if extra.get("echo"):
        assert got[0].startswith(PROMPT)
    if extra.get("max_tokens") == 0:
        assert got[0] == PROMPT
    if "logprobs" in extra:  # the prompt's tokens first, the very first without a logprob
        assert got[1][0][1] is None and len(got[1]) > 6
    if "prompt_logprobs" in extra:
        assert got[2] is not None and got[2][0] is None and len(got[2]) > 1


async def test_sglang_pairs_alone_refuse_echo_with_logprobs_with_a_clear_400(cluster: Cluster) -> None:
    s, _, raw = await post(cluster.url + "/v1/completions", completion("m-sglang", echo=True, logprobs=1))
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == "echo" and err["type"] == "invalid_request_error", err
    assert "SGLang prefill/decode pairs" in err["message"] and "/generate" in err["message"]


@pytest.mark.parametrize("extra", SCORING[1:])
async def test_what_sglang_does_not_score_still_goes_through_its_pair(
    cluster: Cluster, extra: dict[str, Any]
) -> None:
    """SGLang scores the prompt only for echo with logprobs > 0; it ignores `prompt_logprobs`
    and refuses `max_tokens` 0 itself: those go through the pair like any request, and the
    answer (or the engine's own 400) is the colocated server's."""
    body = completion("m-sglang", **extra)
    before = plans(cluster, "m-sglang")
    s, _, raw = await post(cluster.url + "/v1/completions", body)
    rs, _, ref = await post(cluster.reference["m-sglang"].url + "/v1/completions", body)
    assert s == rs, raw
    if extra.get("max_tokens") == 0:
        assert s == 400 and b"max_tokens must be positive" in raw, raw
        return
    assert s == 200 and grew(before, plans(cluster, "m-sglang")) == {"disaggregated"}, raw
    assert answer(raw, False) == answer(ref, False)


async def test_sglang_echo_with_logprobs_goes_to_a_colocated_worker_when_there_is_one(both: Cluster) -> None:
    body = completion("m-sglang", echo=True, logprobs=2)
    before = plans(both, "m-sglang")
    s, _, raw = await post(both.url + "/v1/completions", body)
    assert s == 200, raw
    assert grew(before, plans(both, "m-sglang")) == {"colocated"}
    _, _, ref = await post(both.reference["m-sglang"].url + "/v1/completions", body)
    got = answer(raw, False)
    assert got == answer(ref, False) and got[1][0][1] is None and len(got[1]) > 6
    # and plain requests still prefer the pair
    before = plans(both, "m-sglang")
    s, _, raw = await post(both.url + "/v1/completions", completion("m-sglang", echo=True))
    assert s == 200 and grew(before, plans(both, "m-sglang")) == {"disaggregated"}


async def test_max_tokens_zero_needs_echo(cluster: Cluster) -> None:
    """A completion of 0 tokens is the prompt alone, asked for with `echo`. A chat's 0 is the
    engine's to judge (SGLang answers it, vLLM refuses it: test_lax_fields), served by the vLLM
    decode alone, so no prefill holds KV for it."""
    s, _, raw = await post(cluster.url + "/v1/completions", completion("m-vllm", max_tokens=0))
    assert s == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == "max_tokens" and "0 only with 'echo'" in err["message"]
    body = {"model": "m-vllm", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}
    s, _, raw = await post(cluster.url + "/v1/chat/completions", body)
    assert s == 400, raw
    assert "max_tokens must be at least 1" in json.loads(raw)["error"]["message"]
    assert (await cluster.emulators["vllm-p"].stats())["received"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_vllm_chat_echo_is_served_by_the_decode_alone(cluster: Cluster, stream: bool) -> None:
    """vLLM takes a chat's `echo` as prompt_logprobs = top_logprobs (0 by default), so its decode
    would compute the prompt again: it serves the request alone (no prefill wasted), with the
    last assistant message echoed as the engine does it. `top_logprobs: null` asks for none."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    body = {"model": "m-vllm", "messages": messages, "max_tokens": 6, "temperature": 0, "stream": stream}
    for extra, plan in (
        ({"echo": True}, "decode_self_prefill"),
        ({"echo": True, "top_logprobs": None}, "disaggregated"),
    ):
        before = plans(cluster, "m-vllm")
        s, _, raw = await post(cluster.url + "/v1/chat/completions", {**body, **extra})
        assert s == 200, raw
        assert grew(before, plans(cluster, "m-vllm")) == {plan}
        _, _, ref = await post(cluster.reference["m-vllm"].url + "/v1/chat/completions", {**body, **extra})
        assert generated("/v1/chat/completions", raw, stream) == generated(
            "/v1/chat/completions", ref, stream
        )
        assert generated("/v1/chat/completions", raw, stream)[0].startswith("Well,")
