"""Request fields in the forms the engines take, through SGLang P/D (which the gateway splits into
one handoff per sample and prompt) as through a plain engine. Found by the API probe."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.conftest import Cluster
from tests.integration.test_gateway import body_for, generated, post, sse_events


async def texts(url: str, body: dict[str, Any]) -> list[str]:
    status, _, raw = await post(url + "/v1/completions", body)
    assert status == 200, raw
    return [c["text"] for c in json.loads(raw)["choices"]]


async def test_seeded_samples_differ_and_match_a_plain_engine_whatever_the_seeds_form(
    cluster: Cluster,
) -> None:
    ref = cluster.reference["m-sglang"].url
    base = {"model": "m-sglang", "prompt": "once upon a time", "max_tokens": 6, "n": 3, "temperature": 1}
    for seed in (5, "5", 5.0, " 5", 2**63 - 1):
        got = await texts(cluster.url, {**base, "seed": seed})
        want = await texts(ref, {**base, "seed": seed})
        assert got == want, seed
        assert len(set(got)) == 3, (seed, got)


async def test_generate_takes_return_logprob_per_prompt(cluster: Cluster) -> None:
    body = {
        "text": ["the first prompt", "the second prompt"],
        "return_logprob": [False, True],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    status, _, raw = await post(cluster.url + "/generate", body)
    assert status == 200, raw
    status, _, ref = await post(cluster.reference["m-sglang"].url + "/generate", body)
    assert status == 200, ref
    got, want = json.loads(raw), json.loads(ref)
    assert [g["text"] for g in got] == [w["text"] for w in want]
    for g, w in zip(got, want, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert (g["meta_info"].get(key) or None) == (w["meta_info"].get(key) or None), key


async def test_a_session_id_that_is_not_a_string_is_no_error(cluster: Cluster) -> None:
    """`session_id` is no engine field (the gateway's routing hint): any type goes through."""
    for model in ("m-sglang", "m-vllm", "m-colocated"):
        for sid in (123, {"a": 1}, None, "s-1"):
            body = {"model": model, "prompt": "hi", "max_tokens": 2, "session_id": sid}
            status, _, raw = await post(cluster.url + "/v1/completions", body)
            assert status == 200, (model, sid, raw)


async def test_a_seed_outside_int64_is_a_400_as_from_the_engine(cluster: Cluster) -> None:
    """vLLM refuses a seed outside int64 (the prefill does, before any KV is held); SGLang P/D
    with `n > 1` must not wrap it into one the client never sent."""
    for model in ("m-vllm", "m-sglang"):
        body = {"model": model, "prompt": "hi", "max_tokens": 2, "n": 2, "temperature": 1, "seed": 2**63}
        status, _, raw = await post(cluster.url + "/v1/completions", body)
        ref_status, _, ref = await post(cluster.reference[model].url + "/v1/completions", body)
        assert status == ref_status == 400, (model, raw, ref)
        want = json.loads(ref)
        assert json.loads(raw)["error"]["message"] == want.get("error", want)["message"]  # SGLang: flat


async def test_chat_budgets_with_a_zero_are_read_as_each_engine_reads_them(cluster: Cluster) -> None:
    """SGLang's chat budget is `max_completion_tokens or max_tokens` (a 0 falls through; a
    `max_tokens` of 0 is an empty answer); vLLM's is `max_completion_tokens` whenever it is not
    null, and a 0 is its 400, refused before a prefill holds KV for it. The gateway answers as
    the plain engine does (found by the API probe: it refused all three on every engine)."""
    base = {"messages": [{"role": "user", "content": "count to ten"}], "temperature": 0}
    for budget in (
        {"max_completion_tokens": 0, "max_tokens": 5},
        {"max_completion_tokens": "0", "max_tokens": 5},  # pydantic's lax int: also 0
        {"max_completion_tokens": 0},
        {"max_tokens": 0},
    ):
        for model in ("m-sglang", "m-vllm"):
            body = {"model": model, **base, **budget}
            status, _, raw = await post(cluster.url + "/v1/chat/completions", body)
            ref_status, _, ref = await post(cluster.reference[model].url + "/v1/chat/completions", body)
            assert status == ref_status == (200 if model == "m-sglang" else 400), (budget, model, raw, ref)
            if status == 200:
                got, want = json.loads(raw), json.loads(ref)
                assert got["choices"][0]["message"] == want["choices"][0]["message"], budget
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], budget
    stats = await cluster.emulators["vllm-p"].stats()
    assert stats["held_transfers"] == 0 and stats["received"] == 0, stats


async def test_flags_and_counts_in_pydantics_lax_forms_are_served_as_the_engines_serve_them(
    cluster: Cluster,
) -> None:
    """`"stream": "yes"` streams and `"max_tokens": " 3 "` is 3 tokens, as a plain engine (pydantic's
    lax mode) reads them, on every engine and both OpenAI routes; a count of 2.5 is a 400 that
    pydantic gives too, in OpenAI's error shape, naming the field (not the lax one before it)."""
    for model in ("m-sglang", "m-vllm", "m-colocated"):
        for route in ("/v1/completions", "/v1/chat/completions"):
            body = body_for(route, model, "tell me a story", True)
            body.update(stream="yes", max_tokens=" 3 ", stream_options={"include_usage": "on"})
            status, headers, raw = await post(cluster.url + route, body)
            assert status == 200, (model, route, raw)
            assert headers["content-type"].startswith("text/event-stream"), (model, route)
            events = sse_events(raw)
            assert events[-1] == "[DONE]", (model, route)
            assert events[-2]["usage"]["completion_tokens"] == 3, (model, route, events[-2])
            if model in cluster.reference:  # the same tokens as the engine asked directly
                _, _, ref = await post(cluster.reference[model].url + route, body)
                assert generated(route, raw, True) == generated(route, ref, True), (model, route)

            body = body_for(route, model, "tell me a story", False)
            body.update(stream="off", max_tokens=" 3 ", temperature=" 0 ")
            status, _, raw = await post(cluster.url + route, body)
            assert status == 200, (model, route, raw)
            assert json.loads(raw)["usage"]["completion_tokens"] == 3, (model, route)

            body.update(stream="yes", max_tokens=2.5)
            status, _, raw = await post(cluster.url + route, body)
            assert status == 400, (model, route, raw)
            error = json.loads(raw)["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens", error
            assert error["message"].endswith("got `float` - at `$.max_tokens`"), error
