"""`n > 1` and batches split into one-prompt, one-sample requests and merged back
(gateway/samples.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any

from adapters._split import sample_request
from common.request import parse_request
from common.workers import RouteKind
from gateway.samples import SampleMerger, _sum_usage


class Recorder:
    """The client's side of a response, kept in memory (a `Responder`)."""

    def __init__(self) -> None:
        self.started = False
        self.closed = False
        self.task: asyncio.Task[None] | None = None
        self.status = 0
        self.body = b""
        self.ended = False
        self.corked = 0

    def send(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        self.started, self.status, self.body, self.ended = True, status, body, True

    def start_stream(self, status: int, headers: Sequence[tuple[bytes, bytes]], first: bytes = b"") -> None:
        assert not self.started
        self.started, self.status = True, status
        self.body += first

    def write(self, data: bytes) -> None:
        assert self.started and not self.ended
        self.body += data

    def end(self) -> None:
        self.ended = True

    def cork(self) -> None:
        self.corked += 1

    def uncork(self) -> None:
        self.corked = 0

    def add_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...
    def remove_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None: ...


def parsed(route: RouteKind, body: dict[str, Any]) -> Any:
    path = {RouteKind.GENERATE: "/generate", RouteKind.COMPLETIONS: "/v1/completions"}.get(
        route, "/v1/chat/completions"
    )
    return parse_request(
        route, path, json.dumps(body).encode(), default_model="m", max_n=8, max_tokens_cap=None
    )


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_sample_is_the_request_with_n_1_its_own_seed_and_no_client_rid() -> None:
    req = parsed(
        RouteKind.COMPLETIONS,
        {"model": "m", "prompt": "p", "n": 3, "seed": 10, "rid": "mine", "temperature": 0.5},
    )
    subs = [sample_request(req, j) for j in range(3)]
    bodies = [json.loads(s.body) for s in subs]
    assert [b["n"] for b in bodies] == [1, 1, 1] and [b["seed"] for b in bodies] == [10, 11, 12]
    assert all("rid" not in b and b["prompt"] == "p" and b["temperature"] == 0.5 for b in bodies)
    assert all(s.n == 1 and s.model == "m" for s in subs)
    gen = parsed(
        RouteKind.GENERATE,
        {"text": "p", "sampling_params": {"n": 2, "sampling_seed": 5, "max_new_tokens": 4}},
    )
    sp = json.loads(sample_request(gen, 1).body)["sampling_params"]
    assert sp == {"n": 1, "sampling_seed": 6, "max_new_tokens": 4}
    unseeded = parsed(RouteKind.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2})
    assert "seed" not in json.loads(sample_request(unseeded, 1).body)


def test_a_samples_seed_stays_in_int64_and_a_lax_seed_counts_as_its_number() -> None:
    """Found by the API probe: `seed` 2**63 - 1 with `n` 2 became 2**63 (an engine's 400 naming a
    seed the client never sent), and a seed written "5" or 5.0 was sent unchanged to every
    sample (n identical answers with a 200)."""
    top = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "p", "n": 3, "seed": 2**63 - 1})
    assert [json.loads(sample_request(top, j).body)["seed"] for j in range(3)] == [
        2**63 - 1,
        -(2**63),
        -(2**63) + 1,
    ]
    for lax in ("5", 5.0, " 5", "+5 "):
        req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "p", "n": 3, "seed": lax})
        assert [json.loads(sample_request(req, j).body)["seed"] for j in range(1, 3)] == [6, 7]
    yes = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "p", "n": 2, "seed": True})
    assert json.loads(sample_request(yes, 1).body)["seed"] == 2
    # not an integer to the engines (pydantic refuses "1e3"): every sample gets it as sent
    exp = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": "p", "n": 2, "seed": "1e3"})
    assert json.loads(sample_request(exp, 1).body)["seed"] == "1e3"
    gen = parsed(
        RouteKind.GENERATE,
        {"text": "p", "sampling_params": {"n": 2, "sampling_seed": "7", "max_new_tokens": 4}},
    )
    assert json.loads(sample_request(gen, 1).body)["sampling_params"]["sampling_seed"] == 8


def test_a_generate_batch_gives_each_prompt_its_return_logprob() -> None:
    """SGLang takes `return_logprob` as one bool or one per prompt (found by the API probe: the
    list was a 400)."""
    gen = parsed(
        RouteKind.GENERATE,
        {"text": ["x", "y"], "return_logprob": [False, True], "sampling_params": {"max_new_tokens": 2}},
    )
    assert gen.return_logprob
    units = [sample_request(gen, k) for k in range(2)]
    assert [json.loads(u.body)["return_logprob"] for u in units] == [False, True]
    assert [u.return_logprob for u in units] == [False, True]


def test_a_batch_unit_is_one_prompt_and_one_sample() -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 1})
    bodies = [json.loads(sample_request(req, k).body) for k in range(4)]
    assert [(b["prompt"], b["n"], b["seed"]) for b in bodies] == [
        ("a", 1, 1),
        ("a", 1, 2),
        ("b", 1, 1),
        ("b", 1, 2),
    ]
    ids = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]]})
    assert [json.loads(sample_request(ids, k).body)["prompt"] for k in range(2)] == [[1, 2], [3]]
    assert not sample_request(ids, 1).is_batch and sample_request(ids, 1).prompt_units == 1
    gen = parsed(
        RouteKind.GENERATE,
        {
            "text": ["x", "y"],
            "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5}],
            "logprob_start_len": [0, 2],
            "token_ids_logprob": [4, 5],  # one prompt's ids: shared
            "rid": ["r1", "r2"],
        },
    )
    units = [json.loads(sample_request(gen, k).body) for k in range(2)]
    assert units[1] == {
        "text": "y",
        "sampling_params": {"max_new_tokens": 5, "n": 1},
        "logprob_start_len": 2,
        "token_ids_logprob": [4, 5],
    }
    assert units[0]["text"] == "x" and units[0]["sampling_params"]["max_new_tokens"] == 3


def test_whole_answers_merge_like_the_engine() -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "n": 2})
    out = Recorder()
    m = SampleMerger(req, out)
    loop = asyncio.new_event_loop()
    try:
        for k in range(4):  # unit k = prompt i, sample j: one choice each
            i, j = divmod(k, 2)
            answer = {
                "id": f"cmpl-{k}",
                "object": "text_completion",
                "choices": [{"index": 0, "text": f"p{i}s{j}", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
            }
            m.sink(k, loop.create_future()).send(
                200, [(b"content-type", b"application/json")], json.dumps(answer).encode()
            )  # type: ignore[arg-type]
    finally:
        loop.close()
    m.send_whole()
    got = json.loads(out.body)
    assert got["id"] == "cmpl-0"
    assert [(c["index"], c["text"]) for c in got["choices"]] == [
        (0, "p0s0"),
        (1, "p0s1"),
        (2, "p1s0"),
        (3, "p1s1"),
    ]
    assert got["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}


def test_streams_merge_event_by_event_with_one_usage_and_one_done() -> None:
    req = parsed(
        RouteKind.CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
    )
    out = Recorder()
    m = SampleMerger(req, out)
    loop = asyncio.new_event_loop()
    try:
        sinks = [m.sink(j, loop.create_future()) for j in range(2)]  # type: ignore[arg-type]
    finally:
        loop.close()

    def events(j: int) -> bytes:
        return (
            sse(
                {
                    "id": "c",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
                    "usage": None,
                }
            )
            + sse({"id": "c", "choices": [{"index": 0, "delta": {"content": f"s{j}"}}], "usage": None})
            + sse(
                {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": None}
            )
            + sse(
                {
                    "id": "c",
                    "choices": [],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
                }
            )
            + b"data: [DONE]\n\n"
        )

    a, b = events(0), events(1)
    sinks[1].start_stream(200, [(b"content-type", b"text/event-stream")], b[:7])  # an event cut in two
    sinks[0].start_stream(200, [(b"content-type", b"text/event-stream")], a)
    sinks[1].write(b[7:])
    m.end_stream()
    assert out.ended and out.status == 200
    evs = [e[6:] for e in out.body.decode().split("\n\n") if e]
    assert evs.count("[DONE]") == 1 and evs[-1] == "[DONE]"
    parsed_evs = [json.loads(e) for e in evs[:-1]]
    text: dict[int, str] = {}
    for e in parsed_evs:
        for c in e["choices"]:
            text[c["index"]] = text.get(c["index"], "") + (c["delta"].get("content") or "")
    assert text == {0: "s0", 1: "s1"}
    usages = [e["usage"] for e in parsed_evs if e.get("usage")]
    assert usages == [{"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}]
    assert parsed_evs[-1]["id"] == "c" and parsed_evs[-1]["choices"] == []


def test_a_stream_starts_once_every_unit_of_the_first_wave_has_arrived() -> None:
    """Three units, two started at once: nothing reaches the client until both of the first
    two have sent bytes for it (or ended); then what was held goes out with the head, and a
    later unit's events go straight on."""
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": ["a", "b", "c"], "stream": True})
    out = Recorder()
    head = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"r")]
    m = SampleMerger(req, out, first_wave=2, head=head)
    loop = asyncio.new_event_loop()
    try:
        sinks = [m.sink(k, loop.create_future()) for k in range(3)]  # type: ignore[arg-type]
    finally:
        loop.close()

    def token(text: str) -> bytes:
        return sse({"id": "x", "choices": [{"index": 0, "text": text}], "usage": None})

    sinks[0].start_stream(200, [(b"content-type", b"text/event-stream; charset=utf-8")], token("a0"))
    sinks[0].write(token("a1"))
    sinks[1].start_stream(200, head)  # headers alone (no guard): not yet past a refusal
    assert not out.started
    sinks[1].write(token("b0")[:9])  # its first bytes: the stream starts
    assert out.started and out.status == 200
    sinks[1].write(token("b0")[9:])
    sinks[0].end()
    sinks[2].start_stream(200, head, token("c0"))
    m.end_stream()
    evs = [json.loads(e[6:]) for e in out.body.decode().split("\n\n") if e and e != "data: [DONE]"]
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in evs]
    assert texts == [(0, "a0"), (0, "a1"), (1, "b0"), (2, "c0")]
    assert out.ended


def test_a_unit_that_ends_without_a_byte_has_arrived() -> None:
    req = parsed(RouteKind.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "stream": True})
    out = Recorder()
    m = SampleMerger(req, out)
    loop = asyncio.new_event_loop()
    try:
        sinks = [m.sink(k, loop.create_future()) for k in range(2)]  # type: ignore[arg-type]
    finally:
        loop.close()
    sinks[0].end()
    sinks[1].start_stream(200, [(b"content-type", b"text/event-stream")], b"data: {}\n\n")
    assert out.started and out.body == b"data: {}\n\n"


def test_merged_usage_sums_the_detail_counts_of_every_answer() -> None:
    """Two prompts, two samples each, as SGLang's UsageProcessor counts them: prompt tokens and
    `prompt_tokens_details.cached_tokens` once per prompt (its first sample's), completion
    tokens and `completion_tokens_details` over every answer."""

    def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": 1, "note": "x"},
        }

    got = _sum_usage([usage(5, 2, 0), usage(5, 3, 4), usage(7, 1, 3), usage(7, 4, 6)], 2)
    assert got == {
        "prompt_tokens": 12,
        "completion_tokens": 10,
        "total_tokens": 22,
        "prompt_tokens_details": {"cached_tokens": 3},
        "completion_tokens_details": {"reasoning_tokens": 4, "note": "x"},
    }


def test_merged_usage_counts_details_a_later_answer_has() -> None:
    """Without cache reporting SGLang says `prompt_tokens_details: null` for a prompt with no
    cache hit: a later prompt's hit still counts."""
    a = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7, "prompt_tokens_details": None}
    b = {
        "prompt_tokens": 6,
        "completion_tokens": 2,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    got = _sum_usage([a, b], 1)
    assert got is not None and got["prompt_tokens_details"] == {"cached_tokens": 4}
