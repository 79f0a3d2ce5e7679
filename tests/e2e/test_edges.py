"""Edges of the OpenAI API through the gateway's P/D, against the real engines: one-token answers,
stop strings, per-token logprobs, non-ASCII prompts. Each answer must be the single server's."""

from __future__ import annotations

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import pytest
from openai import BadRequestError, OpenAI

from tests.e2e._support import (
    GENERATED_TOKENS,
    KINDS,
    Kind,
    Lane,
    _text,
    call,
    metric,
    post_json,
    post_status,
    scrape,
    wait_idle,
)
from tests.e2e.handoff import vllm_handoff

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_one_token_answers(lane: Lane, gateway: OpenAI, reference: OpenAI, kind: Kind, stream: bool) -> None:
    """max_tokens=1: the decode's whole answer is the token the prefill sampled."""
    prompt = _text(random.Random(f"one-{kind}-{stream}"), 25)
    got = call(gateway, kind, prompt, 1, stream, lane.model)
    want = call(reference, kind, prompt, 1, stream, lane.model)
    assert got.same_generation() == want.same_generation()
    assert got.text and got.finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings(lane: Lane, gateway: OpenAI, reference: OpenAI, kind: Kind, stream: bool) -> None:
    prompt = _text(random.Random(f"stop-{kind}-{stream}"), 30)
    full = call(reference, kind, prompt, 24, False, lane.model)
    stop = full.text[6:9]  # a piece of what the model says: the answer stops before it
    assert stop.strip(), full.text
    got = call(gateway, kind, prompt, 24, stream, lane.model, stop=[stop])
    want = call(reference, kind, prompt, 24, stream, lane.model, stop=[stop])
    assert got.text == want.text and got.finish_reason == want.finish_reason == "stop"
    assert stop not in got.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_on_the_first_token(
    lane: Lane, gateway: OpenAI, reference: OpenAI, kind: Kind, stream: bool
) -> None:
    """The answer's first token is a stop token: the answer is empty, or with `min_tokens` goes on
    past it. vLLM's prefill (sent neither `min_tokens` nor more than one token) then ends "stop"
    and hands over no KV (`kv_transfer_params` null: its connectors do so only for a prefill
    capped by length); the decode computes the prompt itself. Either way the answer is the single
    server's, with no upstream error, retry, fallback or guard failure counted."""
    prompt = _text(random.Random(f"stop-first-{kind}-{stream}"), 30)
    full = call(reference, kind, prompt, 12, False, lane.model)
    assert full.token_ids, full
    before = scrape(lane.gateway)
    for extra in ({}, {"min_tokens": 1}):
        extra["stop_token_ids"] = [full.token_ids[0]]
        got = call(gateway, kind, prompt, 12, stream, lane.model, **extra)
        want = call(reference, kind, prompt, 12, stream, lane.model, **extra)
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), extra
    after = scrape(lane.gateway)
    for name in ("upstream_errors", "retries", "fallbacks", "guard_failures"):
        assert metric(after, f"pdgw_{name}_total") == metric(before, f"pdgw_{name}_total"), name


def _logprobs(client: OpenAI, model: str, prompt: str, max_tokens: int = 6) -> Any:
    r = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=2
    )
    return r.choices[0].logprobs


def test_completion_logprobs(lane: Lane, gateway: OpenAI, reference: OpenAI) -> None:
    prompt = _text(random.Random("logprobs"), 40)
    if lane.engine == "vllm":
        # vLLM's CPU build compiles its logprobs path on the first request that asks for them:
        # seconds with a warm compile cache, more than the gateway's 60 s prefill deadline on a
        # cold machine (seen in this lane). Warm each server first, one at a time.
        for base in (lane.reference, lane.prefill, lane.decode):
            _logprobs(lane.client(base, timeout=600), lane.model, "warm up", max_tokens=1)
    got, want = _logprobs(gateway, lane.model, prompt), _logprobs(reference, lane.model, prompt)
    assert got.tokens == want.tokens
    assert len(got.token_logprobs) == len(want.token_logprobs) == 6
    for g, w in zip(got.token_logprobs, want.token_logprobs, strict=True):
        assert abs(g - w) < 1e-3, (got.token_logprobs, want.token_logprobs)
    assert [sorted(t) for t in got.top_logprobs] == [sorted(t) for t in want.top_logprobs]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", KINDS)
def test_non_ascii_prompt(lane: Lane, gateway: OpenAI, reference: OpenAI, kind: Kind, stream: bool) -> None:
    prompt = "Grüße aus Köln — 東京 и Москва: 🙂 " + _text(random.Random(f"utf8-{kind}"), 12)
    got = call(gateway, kind, prompt, 10, stream, lane.model)
    want = call(reference, kind, prompt, 10, stream, lane.model)
    assert got.same_generation() == want.same_generation()
    assert got.prompt_tokens == want.prompt_tokens or stream


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo(lane: Lane, gateway: OpenAI, reference: OpenAI, stream: bool) -> None:
    """`echo`: the answer repeats the prompt before its tokens (the guards must not take the
    echoed prompt for the first token)."""
    prompt = _text(random.Random(f"echo-{stream}"), 15)
    got = call(gateway, "completions", prompt, 8, stream, lane.model, echo=True)
    want = call(reference, "completions", prompt, 8, stream, lane.model, echo=True)
    assert got.text == want.text and got.finish_reason == want.finish_reason
    assert got.text  # (what is echoed is the engine's business: vLLM with return_token_ids does not)


def test_chat_max_completion_tokens(lane: Lane, gateway: OpenAI, reference: OpenAI) -> None:
    messages = [{"role": "user", "content": _text(random.Random("mct"), 20)}]
    kw: dict[str, Any] = {"model": lane.model, "messages": messages, "temperature": 0}
    got = gateway.chat.completions.create(max_completion_tokens=9, **kw)
    want = reference.chat.completions.create(max_completion_tokens=9, **kw)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage is not None and want.usage is not None
    assert got.usage.completion_tokens == want.usage.completion_tokens == 9


def _scored(client: OpenAI, model: str, prompt: str, **kw: Any) -> Any:
    return client.completions.create(model=model, prompt=prompt, temperature=0, echo=True, **kw).choices[0]


def test_echo_with_logprobs_scores_the_prompt_or_is_refused(
    lane: Lane, gateway: OpenAI, reference: OpenAI
) -> None:
    """`echo` + `logprobs` asks for the prompt's logprobs (lm-eval's loglikelihood request). A
    P/D decode is handed the prompt's KV instead of computing it, so the gateway serves the
    request on vLLM's decode alone (its answer must be the single server's), and refuses it
    with a 400 naming `echo` where only an SGLang pair could serve it (SGLang's decode answer
    would lack the prompt's logprobs)."""
    prompt = _text(random.Random("echo-logprobs"), 20)
    if lane.engine == "sglang":
        with pytest.raises(BadRequestError) as ei:
            _scored(gateway, lane.model, prompt, max_tokens=4, logprobs=1)
        body = ei.value.body
        assert isinstance(body, dict) and body["param"] == "echo", body
        _sglang_decode_lacks_the_prompt_logprobs(lane, reference, prompt)
        return
    for base in (lane.reference, lane.decode):  # the CPU build compiles its logprobs path once
        _scored(lane.client(base, timeout=600), lane.model, "warm up", max_tokens=1, logprobs=1)
    got = _scored(gateway, lane.model, prompt, max_tokens=4, logprobs=1)
    want = _scored(reference, lane.model, prompt, max_tokens=4, logprobs=1)
    assert got.text == want.text and got.text.startswith(prompt)
    assert got.logprobs is not None and want.logprobs is not None
    assert got.logprobs.tokens == want.logprobs.tokens and len(got.logprobs.tokens) > 4
    assert got.logprobs.token_logprobs[0] is None
    for g, w in zip(got.logprobs.token_logprobs[1:], want.logprobs.token_logprobs[1:], strict=True):
        assert abs(g - w) < 1e-3
    # the prompt alone: max_tokens 0 with echo
    only = _scored(gateway, lane.model, prompt, max_tokens=0, logprobs=1)
    assert only.text == _scored(reference, lane.model, prompt, max_tokens=0, logprobs=1).text == prompt


def _sglang_decode_lacks_the_prompt_logprobs(lane: Lane, reference: OpenAI, prompt: str) -> None:
    """Why the gateway refuses: the pair, asked directly (prefill and decode at once, one
    bootstrap room), answers echo + logprobs with fewer logprob entries than the single server,
    which scores the prompt."""
    bootstrap = os.environ.get("E2E_BOOTSTRAP_PORT")
    assert bootstrap, "the lane did not export E2E_BOOTSTRAP_PORT"
    body = {
        "model": lane.model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "bootstrap_host": urlsplit(lane.prefill).hostname,
        "bootstrap_port": int(bootstrap),
        "bootstrap_room": random.Random("echo-room").randrange(1 << 62),
    }

    def post(base: str) -> Any:
        return json.loads(post_json(base + "/v1/completions", body))

    with ThreadPoolExecutor(2) as ex:
        fut_p, fut_d = ex.submit(post, lane.prefill), ex.submit(post, lane.decode)
        fut_p.result()
        decoded = fut_d.result()
    want = _scored(reference, lane.model, prompt, max_tokens=4, logprobs=1)
    assert want.logprobs is not None and len(want.logprobs.tokens) > 4
    got = decoded["choices"][0]
    scored = (got.get("logprobs") or {}).get("tokens") or []
    assert got["text"] == want.text and len(scored) < len(want.logprobs.tokens)  # echoed, not scored


INVALID_PARAMETERS: list[dict[str, Any]] = [
    {"temperature": -1.0},
    {"top_p": 1.5},
    {"top_k": -5},
    {"presence_penalty": 3.0},
    {"min_tokens": 9},  # more than max_tokens (4)
    {"min_tokens": -1},
    {"stream_options": {"include_usage": True}},  # without stream
]


def _message(raw: bytes) -> str:
    body = json.loads(raw)
    err = body.get("error")
    return str(err.get("message") if isinstance(err, dict) else body.get("message") or err)


@pytest.mark.parametrize("kind", KINDS)
def test_invalid_parameters_get_the_engines_own_answer(lane: Lane, kind: Kind) -> None:
    """A request the engine refuses is refused through the gateway with the same status and the
    engine's own message (in OpenAI's shape), and leaves nothing running on the pair: no SGLang
    bootstrap room waiting for KV, no vLLM decode. vLLM's prefill is not sent `stream_options`
    or `min_tokens`: the gateway checks those itself, in vLLM's words, before either leg."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Say something"}]} if kind == "chat" else {"prompt": "Once"}
    )
    refused = 0
    hits = metric(scrape(lane.gateway), "pdgw_guard_failures_total")
    prefilled = metric(scrape(lane.prefill), GENERATED_TOKENS["vllm"]) if lane.engine == "vllm" else 0.0
    for extra in INVALID_PARAMETERS:
        body = {"model": lane.model, "max_tokens": 4, "temperature": 0, **prompt, **extra}
        want_status, want = post_status(lane.reference + path, body)
        got_status, got = post_status(lane.gateway + path, body)
        assert got_status == want_status, (extra, got_status, got[:300], want_status, want[:300])
        if want_status != 200:
            refused += 1
            assert _message(got) == _message(want), (extra, got[:300], want[:300])
            assert set(json.loads(got)["error"]) == {"message", "type", "param", "code"}, got[:300]
    assert refused >= 3, "the engine took (nearly) every invalid request: the test proves nothing"
    # the request's fault, not a broken handoff the guards caught
    assert metric(scrape(lane.gateway), "pdgw_guard_failures_total") == hits
    if lane.engine == "vllm":  # nothing was prefilled for a request the decode would refuse
        assert metric(scrape(lane.prefill), GENERATED_TOKENS["vllm"]) == prefilled
    left = wait_idle(lane.engine, [lane.prefill, lane.decode], within_s=15)
    assert all(v == 0 for r in left.values() for v in r.values()), left
    ok_status, ok = post_status(lane.gateway + path, {"model": lane.model, "max_tokens": 4, **prompt})
    assert ok_status == 200, ok[:300]


@pytest.mark.parametrize("kind", KINDS)
def test_the_prefills_best_first_tokens_are_read(lane: Lane, kind: Kind) -> None:
    """The near-tie check's input from a real vLLM prefill: a greedy request's prefill, built as
    the gateway builds it, answers the logprobs of its 3 best first tokens beside its
    `kv_transfer_params`, and the adapter reads the other two (every one a tie under a huge
    margin). The handoff is then completed on the real decode, which frees the prefill's KV."""
    if lane.engine != "vllm":
        pytest.skip("SGLang ships the prefill's first token: no near ties to read")

    prompt = _text(random.Random(f"ties-{kind}"), 20)
    # vLLM's CPU build compiles its logprobs path on the first request that asks (see above)
    h = vllm_handoff(lane.prefill, lane.decode, lane.model, kind, prompt, 6)
    assert len(h.verdict.ties) == 2, h.verdict
    assert h.answer["usage"]["completion_tokens"] == 6
