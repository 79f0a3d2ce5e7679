"""The KV-integrity guards and the stream watch, on real engine shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters._stream import STREAM_END_MARKERS, without_usage_chunk
from adapters._summary import summarize_generate, summarize_openai
from common.summary import Summary
from common.workers import Role
from gateway.config import GuardsConfig
from gateway.guards import check_decode, preflight
from gateway.orchestration.shadow import texts_agree
from gateway.streamwatch import StreamStopped, StreamWatch
from policies.testing import make_worker

CAPTURES = Path(__file__).resolve().parents[1] / "fixtures" / "captures"


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"  # compact, as engines


def chunk(i: int, text: str, finish: str | None = None) -> bytes:
    return ev({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def test_preflight_refuses_only_what_surely_cannot_fit() -> None:
    s = GuardsConfig()
    w = make_worker("d", Role.DECODE, context_length=100)
    p = make_worker("p", Role.PREFILL, context_length=100, max_input_len=50)
    assert preflight(40, True, 50, (w,), s) is None
    assert "context length" in (preflight(60, True, 50, (w,), s) or "")
    assert "fewer than 50" in (preflight(60, True, 1, (p, w), s) or "")
    # text: 1,000 bytes is at most 1,000 tokens but at least 1000/16 = 62: not surely too long
    assert preflight(1000, False, 10, (w,), s) is None
    assert preflight(2000, False, 10, (w,), s) is not None
    # a one-byte prompt is still one token: max_tokens alone cannot take the whole context
    assert (preflight(1, False, 100, (w,), s) or "").startswith("max_tokens (100) leaves no room")
    assert preflight(1, False, 99, (w,), s) is None


def test_decode_checks() -> None:
    p = Summary(prompt_tokens=27, first_token_id=5, first_text=",")
    ok = Summary(
        prompt_tokens=27, completion_tokens=6, finish_reason="length", first_token_id=5, first_text=",ab"
    )
    assert check_decode(p, ok, max_tokens=6, context_length=100, greedy=True) is None
    assert "prompt tokens" in (
        check_decode(p, Summary(prompt_tokens=1), max_tokens=6, context_length=100, greedy=True) or ""
    )
    early = Summary(prompt_tokens=27, completion_tokens=1, finish_reason="length")
    assert "after 1 of 6" in (check_decode(p, early, max_tokens=6, context_length=100, greedy=False) or "")
    # no max_tokens (the usual chat): the engine's default budget is never one token short of a
    # known context (found by the fault probe: the aborted transfer reached the client as a 200)
    assert "after 1 tokens" in (
        check_decode(p, early, max_tokens=None, context_length=100, greedy=False) or ""
    )
    last_room = Summary(prompt_tokens=99, completion_tokens=1, finish_reason="length")
    assert check_decode(Summary(), last_room, max_tokens=None, context_length=100, greedy=False) is None
    assert check_decode(p, early, max_tokens=None, context_length=None, greedy=False) is None
    at_ctx = Summary(prompt_tokens=95, completion_tokens=5, finish_reason="length")
    assert check_decode(Summary(), at_ctx, max_tokens=20, context_length=100, greedy=False) is None
    # engines' own caps are no failure: SGLang's clamp 2 tokens short of the context (here after
    # one token), an operator's limit on new tokens (SGLANG_MAX_NEW_TOKENS_LIMIT, vLLM's
    # generation-config override) far below max_tokens
    clamped = Summary(prompt_tokens=97, completion_tokens=1, finish_reason="length")
    assert check_decode(Summary(), clamped, max_tokens=20, context_length=100, greedy=False) is None
    capped = Summary(prompt_tokens=27, completion_tokens=16, finish_reason="length")
    assert check_decode(p, capped, max_tokens=30, context_length=100, greedy=False) is None
    short_of_clamp = Summary(prompt_tokens=96, completion_tokens=1, finish_reason="length")
    assert check_decode(Summary(), short_of_clamp, max_tokens=20, context_length=100, greedy=False)
    other = Summary(prompt_tokens=27, first_token_id=9)
    assert "first token" in (check_decode(p, other, max_tokens=6, context_length=None, greedy=True) or "")
    assert check_decode(p, other, max_tokens=6, context_length=None, greedy=False) is None
    text_only = Summary(first_text=",")
    assert check_decode(text_only, Summary(first_text="x"), max_tokens=None, context_length=None, greedy=True)


def test_summaries_of_real_captures() -> None:
    cap = json.loads((CAPTURES / "sglang_generate_stream.json").read_text())
    payloads = [ln[6:].encode() for ln in cap["decode"]["raw_body"].splitlines() if ln.startswith("data: {")]
    s = summarize_generate(payloads)
    assert s.prompt_tokens == 8 and s.completion_tokens == 12 and s.finish_reason == "length"
    assert s.first_token_id == 289
    cap = json.loads((CAPTURES / "vllm_chat_stream_usage.json").read_text())
    payloads = [ln[6:].encode() for ln in cap["decode"]["raw_body"].splitlines() if ln.startswith("data: {")]
    s = summarize_openai(payloads)
    assert s.prompt_tokens and s.completion_tokens and s.finish_reason in ("length", "stop") and s.first_text


def watch(check_first: object = None, check_end: object = None) -> tuple[StreamWatch, list[bytes]]:
    out: list[bytes] = []
    w = StreamWatch(
        out.append,
        summarize_openai,
        check_first or (lambda s: None),  # type: ignore[arg-type]
        check_end or (lambda s: None),  # type: ignore[arg-type]
        ends=STREAM_END_MARKERS,
    )
    return w, out


def test_stream_watch_passes_a_good_stream_byte_for_byte_in_odd_pieces() -> None:
    stream = b"".join([chunk(0, "a"), chunk(1, "b"), chunk(2, "c", "length"), b"data: [DONE]\n\n"])
    for size in (1, 7, 64, len(stream)):
        w, out = watch()
        for i in range(0, len(stream), size):
            w.feed(stream[i : i + size])
        assert w.finish() is None
        assert b"".join(out) == stream


def test_stream_watch_releases_tokens_as_they_come() -> None:
    w, out = watch()
    w.feed(chunk(0, "a"))
    assert b"".join(out) == chunk(0, "a")  # the first token was checked and passed at once
    w.feed(chunk(1, "b"))
    assert b"".join(out).endswith(chunk(1, "b"))
    w.feed(chunk(2, "c", "length"))
    assert not b"".join(out).endswith(chunk(2, "c", "length"))  # the end is held until checked
    w.feed(b"data: [DONE]\n\n")
    assert w.finish() is None and b"".join(out).endswith(b"[DONE]\n\n")


def test_stream_watch_stops_a_bad_first_token_before_any_byte() -> None:
    w, out = watch(check_first=lambda s: "bad" if s.first_text == "x" else None)
    with pytest.raises(StreamStopped):  # raised out of a pipe's sink, it stops the pipe
        w.feed(chunk(0, "x") + chunk(1, "y"))
    w.feed(chunk(2, "z"))  # anything after is dropped
    assert out == [] and w.violation == "bad" and w.finish() == "bad"


def test_stream_watch_holds_back_a_bad_ending() -> None:
    seen: list[Summary] = []

    def end(s: Summary) -> str | None:
        seen.append(s)
        return "early" if (s.completion_tokens or 0) < 5 else None

    w, out = watch(check_end=end)
    usage = ev({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    w.feed(chunk(0, "a") + chunk(1, "b", "length") + usage + b"data: [DONE]\n\n")
    assert w.finish() == "early"
    assert b"".join(out) == chunk(0, "a") and b"[DONE]" not in b"".join(out)
    assert seen[0].completion_tokens == 2


@pytest.mark.parametrize("usage", [True, False])
def test_stream_watch_counts_from_usage_when_present(usage: bool) -> None:
    seen: list[Summary] = []
    w, _ = watch(check_end=lambda s: seen.append(s) or None)  # type: ignore[func-returns-value]
    body = chunk(0, "a") + chunk(1, "b") + chunk(2, "c", "length")
    if usage:
        body += ev({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    w.feed(body + b"data: [DONE]\n\n")
    assert w.finish() is None
    # without usage there is no count: events are not tokens (SGLang's --stream-interval)
    assert seen[0].completion_tokens == (3 if usage else None)
    assert seen[0].prompt_tokens == (4 if usage else None)


@pytest.mark.parametrize("drop", [True, False])
def test_stream_watch_drops_the_usage_chunk_the_gateway_asked_for(drop: bool) -> None:
    out: list[bytes] = []
    w = StreamWatch(
        out.append,
        summarize_openai,
        lambda s: None,
        lambda s: None,
        ends=STREAM_END_MARKERS,
        drop_usage=without_usage_chunk if drop else None,
    )
    usage = ev({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}})
    body = chunk(0, "a") + chunk(1, "b") + chunk(2, "c", "length") + usage + b"data: [DONE]\n\n"
    w.feed(body)
    assert w.finish() is None
    want = body.replace(usage, b"") if drop else body
    assert b"".join(out) == want


def test_text_that_a_parser_took_apart_is_not_compared() -> None:
    """A reasoning parser (vLLM `--reasoning-parser qwen3`) cannot split the prefill's one token
    ("<think>": it stays in `content`), while the decode's answer comes as `reasoning_content`
    and a `content` that starts after it: no first-text comparison holds. Token ids still do."""
    prefill = summarize_openai([json.dumps({"choices": [{"message": {"content": "<think>"}}]}).encode()])
    decode = summarize_openai(
        [
            json.dumps(
                {"choices": [{"message": {"content": "\n\nParis.", "reasoning_content": "The user asks"}}]}
            ).encode()
        ]
    )
    assert decode.parsed and not prefill.parsed
    assert check_decode(prefill, decode, max_tokens=None, context_length=None, greedy=True) is None
    plain = summarize_openai([json.dumps({"choices": [{"message": {"content": "\n\nParis."}}]}).encode()])
    assert check_decode(prefill, plain, max_tokens=None, context_length=None, greedy=True)
    tools = summarize_openai(
        [json.dumps({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]}).encode()]
    )
    assert tools.parsed
    empty = summarize_openai(
        [json.dumps({"choices": [{"message": {"content": "x", "tool_calls": []}}]}).encode()]
    )
    assert not empty.parsed


def test_stream_watch_releases_a_reasoning_stream_at_its_first_event() -> None:
    """A stream whose first tokens are reasoning (`delta.reasoning_content`) is relayed from its
    first event, not held back until its first `content` (the whole reasoning, maybe)."""
    seen: list[Summary] = []
    out: list[bytes] = []
    w = StreamWatch(
        out.append, summarize_openai, lambda s: seen.append(s), lambda s: None, ends=STREAM_END_MARKERS
    )  # type: ignore[arg-type,func-returns-value]
    first = ev({"choices": [{"index": 0, "delta": {"reasoning_content": "Let me"}, "finish_reason": None}]})
    w.feed(first)
    assert b"".join(out) == first and seen and seen[0].parsed


def test_shadow_texts_agree_over_a_character_cut_in_half() -> None:
    assert texts_agree("naïve answer", "na\ufffd")  # the shadow ended inside "ï"
    assert texts_agree("na\ufffd", "na")
    assert texts_agree("abc", "ab") and texts_agree("ab", "abc")
    assert not texts_agree("abc", "abd") and not texts_agree("xyz", "a\ufffd")


def test_a_first_token_near_tied_with_the_prefills_is_no_failure() -> None:
    """A decode that starts on one of the prefill's near ties (by text, or where ids are compared,
    by its text too) passes and is marked `tied`; any other token stays a failure."""
    prefill = Summary(prompt_tokens=3, first_text=" the", ties=(" a", "An"))
    for start, ok in ((" a", True), (" a cat", True), ("An", True), (" dog", False), ("", True)):
        decode = Summary(prompt_tokens=3, first_text=start)
        why = check_decode(prefill, decode, max_tokens=None, context_length=None, greedy=True)
        assert (why is None) is ok, (start, why)
        assert decode.tied is (ok and start != ""), start
    ids = Summary(prompt_tokens=3, first_token_id=7, first_text=" the", ties=(" a",))
    tied = Summary(prompt_tokens=3, first_token_id=9, first_text=" a")
    assert check_decode(ids, tied, max_tokens=None, context_length=None, greedy=True) is None and tied.tied
    other = Summary(prompt_tokens=3, first_token_id=9, first_text=" b")
    assert check_decode(ids, other, max_tokens=None, context_length=None, greedy=True) is not None
    # without ties (SGLang, sampled, not asked) a different token is a failure as before
    plain = Summary(prompt_tokens=3, first_text=" the")
    assert check_decode(plain, Summary(first_text=" a"), max_tokens=None, context_length=None, greedy=True)


@pytest.mark.parametrize("spaced", [True, False], ids=["openai_routes", "generate"])
@pytest.mark.parametrize("together", [False, True], ids=["apart", "one_read"])
def test_stream_watch_takes_an_engine_error_event_mid_stream_for_a_failure(
    spaced: bool, together: bool
) -> None:
    """Both engines write an OpenAI route's error event with `json.dumps` (spaced: `{"error": {`),
    SGLang's /generate ones compact, and `[DONE]` after it. After the first token the watch must
    hold it back and report the engine's failure (the gateway then ends the stream with its own
    error event, no `[DONE]`), never relay it as a clean end."""
    err = {
        "error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", "code": 500}
    }
    event = (
        b"data: " + (json.dumps(err) if spaced else json.dumps(err, separators=(",", ":"))).encode() + b"\n\n"
    )
    pieces = [chunk(0, "a"), chunk(1, "b"), event, b"data: [DONE]\n\n"]
    w, out = watch()
    if together:
        w.feed(pieces[0])
        w.feed(b"".join(pieces[1:]))
    else:
        for p in pieces:
            w.feed(p)
    assert w.finish() is None
    assert w.failed is not None and "EngineCore" in w.failed
    assert b"".join(out) == pieces[0] + pieces[1]
