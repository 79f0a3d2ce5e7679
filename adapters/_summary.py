"""Read what an engine's answer says about itself (tokens, finish reason, first token), from the
OpenAI-style shapes both engines use and SGLang's native `/generate` shape."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from common.jsonbytes import iter_sse_data
from common.summary import Summary


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    # what a reasoning or tool-call parser took out of the text (vLLM: `reasoning` too)
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    message: _Message | None = None
    delta: _Message | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class _Error(msgspec.Struct):
    message: str | None = None


class _OpenAI(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _Error | str | None = None


class _Finish(msgspec.Struct):
    type: str | None = None
    message: str | None = None


class _Meta(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: _Finish | None = None


class _Generate(msgspec.Struct):
    text: str | None = None
    output_ids: list[int] | None = None
    meta_info: _Meta | None = None
    index: int = 0


_openai = msgspec.json.Decoder(_OpenAI)
_generate = msgspec.json.Decoder(_Generate)


def summarize_openai(payloads: Iterable[bytes]) -> Summary:
    """Choice 0 of a completions / chat answer, whole or as stream events."""
    s = Summary()
    for p in payloads:
        try:
            o = _openai.decode(p)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if o.error is not None:
            s.error = o.error if isinstance(o.error, str) else (o.error.message or "error event")
        if o.usage is not None:
            s.prompt_tokens = o.usage.prompt_tokens
            s.completion_tokens = o.usage.completion_tokens
        for c in o.choices:
            if c.index != 0:
                continue
            m = c.message or c.delta
            piece = c.text if c.text is not None else (m.content if m is not None else None)
            if m is not None and (m.reasoning_content or m.reasoning or m.tool_calls):
                s.parsed = True
            if piece and s.first_text is None:  # (the first piece of text is all that is read)
                s.first_text = piece
            if c.token_ids and s.first_token_id is None:
                s.first_token_id = c.token_ids[0]
            if c.finish_reason is not None:
                s.finish_reason = c.finish_reason
                if c.finish_reason == "abort":
                    s.error = "the engine aborted the request"
    return s


def summarize_generate(payloads: Iterable[bytes]) -> Summary:
    """SGLang `/generate`: a whole answer, or stream events (cumulative `output_ids`)."""
    s = Summary()
    for p in payloads:
        try:
            g = _generate.decode(p)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if g.index != 0:
            continue
        if g.output_ids and s.first_token_id is None:
            s.first_token_id = g.output_ids[0]
        if g.text and s.first_text is None:
            s.first_text = g.text
        if g.meta_info is not None:
            s.prompt_tokens = g.meta_info.prompt_tokens
            s.completion_tokens = g.meta_info.completion_tokens
            if g.meta_info.finish_reason is not None:
                s.finish_reason = g.meta_info.finish_reason.type
                if s.finish_reason == "abort":
                    s.error = g.meta_info.finish_reason.message or "the engine aborted the request"
    return s


def payloads_of(body: bytes) -> list[bytes]:
    """A prefill's answer as payloads to summarize: its `data:` payloads when it came as a
    stream, else the whole body."""
    if body.lstrip().startswith(b"data:"):
        return list(iter_sse_data(body))
    return [body]


class _Choice0(msgspec.Struct):
    text: str | None = None
    message: dict[str, object] | None = None


class _Answer(msgspec.Struct):
    choices: list[_Choice0] = []
    text: str | None = None  # SGLang's /generate


_answer = msgspec.json.Decoder(_Answer)


class _StreamChoice(msgspec.Struct):
    text: str | None = None
    delta: dict[str, object] | None = None


class _StreamEvent(msgspec.Struct):
    choices: list[_StreamChoice] = []
    text: str | None = None  # SGLang's /generate: the text so far


_stream_event = msgspec.json.Decoder(_StreamEvent)


def stream_text(raw: bytes) -> str | None:
    """The text of a one-answer completions, chat or `/generate` stream (its SSE bytes)."""
    parts: list[str] = []
    for payload in iter_sse_data(raw):
        try:
            ev = _stream_event.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if ev.text is not None:  # /generate: each event has the whole text so far
            parts = [ev.text]
            continue
        for c in ev.choices:
            if c.text is not None:
                parts.append(c.text)
            elif c.delta is not None:
                content = c.delta.get("content")
                if isinstance(content, str):
                    parts.append(content)
    return "".join(parts)


def answer_text(body: bytes) -> str | None:
    """Choice 0's text of a completions or chat answer, or a `/generate` answer's text."""
    try:
        a = _answer.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if a.text is not None:
        return a.text
    if not a.choices:
        return None
    c = a.choices[0]
    if c.text is not None:
        return c.text
    content = (c.message or {}).get("content")
    return content if isinstance(content, str) else None
