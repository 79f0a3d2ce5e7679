"""Batches on SGLang P/D get the KV-integrity guards too (found by a probe: a batch was sent
whole, one engine request with one answer per prompt that no guard checked, and a decode that
aborted its transfer, sglang #33507's "200 with finish_reason length after one token", reached
the client as a clean 200 with one-token answers). Each prompt of a batch is now its own guarded
handoff, merged back as the engine would answer: with the fault, the guard catches it and the
colocated rung serves the right tokens; without it, the merged batch equals a single server's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.integration.conftest import build_cluster, stop_cluster
from tests.integration.test_client_compat import guard_hits
from tests.integration.test_gateway import post, sse_events

PROMPTS = ["The quick brown fox", "Lorem ipsum dolor", "w1 w2 w3 w4 w5 w6"]


def request(route: str, stream: bool, n: int = 1) -> dict[str, Any]:
    if route == "/generate":
        return {
            "model": "m-sglang",
            "text": PROMPTS,
            "stream": stream,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True, "n": n},
        }
    return {
        "model": "m-sglang",
        "prompt": PROMPTS,
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "n": n,
    }


def answers(route: str, raw: bytes, stream: bool) -> dict[int, tuple[str, str | None]]:
    """{index: (text, finish reason)}, stream deltas joined; a stream must end with [DONE]."""
    out: dict[int, tuple[str, str | None]] = {}
    if not stream:
        items = json.loads(raw)
        if route == "/generate":
            return {i: (x["text"], x["meta_info"]["finish_reason"]["type"]) for i, x in enumerate(items)}
        return {c["index"]: (c["text"], c["finish_reason"]) for c in items["choices"]}
    events = sse_events(raw)
    assert events[-1] == "[DONE]", events[-3:]
    for ev in events[:-1]:
        if route == "/generate":
            # SGLang's stream: each event carries its prompt's text so far
            fin = ev["meta_info"]["finish_reason"]
            out[ev.get("index", 0)] = (ev["text"], fin["type"] if fin else None)
            continue
        for c in ev.get("choices") or ():
            text, fin = out.get(c["index"], ("", None))
            out[c["index"]] = (text + c["text"], c.get("finish_reason") or fin)
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_a_broken_handoff_in_a_batch_is_caught_and_served_right(route: str, stream: bool) -> None:
    c = await build_cluster(faults={"sgl-d": ["abort_during_transfer"]}, colocated_fallback=True)
    try:
        body = request(route, stream)
        status, _, raw = await post(c.url + route, body)
        assert status == 200, raw
        _, _, want = await post(c.reference["m-sglang"].url + route, body)
        got = answers(route, raw, stream)
        assert got == answers(route, want, stream)
        assert all(len(text) > 1 for text, _ in got.values()), got  # not one-token answers
        assert guard_hits(c) >= 1  # the guard's catch, then the colocated rung
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_a_healthy_batch_is_the_single_servers_answer(route: str, stream: bool) -> None:
    c = await build_cluster()
    try:
        for n in (1, 2):
            body = request(route, stream, n)
            status, _, raw = await post(c.url + route, body)
            assert status == 200, raw
            _, _, want = await post(c.reference["m-sglang"].url + route, body)
            got = answers(route, raw, stream)
            assert len(got) == len(PROMPTS) * n and got == answers(route, want, stream)
            if not stream and route != "/generate":
                usage, ref_usage = json.loads(raw)["usage"], json.loads(want)["usage"]
                assert usage["prompt_tokens"] == ref_usage["prompt_tokens"]
                assert usage["completion_tokens"] == ref_usage["completion_tokens"] == 10 * len(PROMPTS) * n
        assert guard_hits(c) == 0
    finally:
        await stop_cluster(c)
