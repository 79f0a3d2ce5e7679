"""Read the cached prompt tokens an engine reports in an answer (`common.summary.CachedTokens`):
SGLang's `/generate` `meta_info.cached_tokens`, OpenAI's `usage.prompt_tokens_details.cached_tokens`.

A whole answer is decoded for those fields alone; a stream is read from its end, the bytes of
its last reads (`UpstreamResponse.tail`), where the engines put the final usage chunk
(`stream_options.include_usage`) or, on `/generate`, an event whose `meta_info` has the count
(each event carries it): nothing is looked at per chunk while the stream flows.
"""

from __future__ import annotations

import msgspec

from common.summary import CachedTokens


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _OpenAI(msgspec.Struct):
    usage: _Usage | None = None


class _Meta(msgspec.Struct):
    cached_tokens: int | None = None
    prompt_tokens: int | None = None


class _Generate(msgspec.Struct):
    meta_info: _Meta | None = None


_openai = msgspec.json.Decoder(_OpenAI)
_generate_any = msgspec.json.Decoder(_Generate | list[_Generate])
_USAGE = b'"usage"'
_META = b'"meta_info"'


def from_usage(usage: _Usage | None) -> CachedTokens | None:
    """What an OpenAI usage object says (None: no usage object at all)."""
    return None if usage is None else from_details(usage.prompt_tokens_details, usage.prompt_tokens)


def from_details(details: _Details | None, prompt: int | None = None) -> CachedTokens:
    """What a usage object's `prompt_tokens_details` (None: absent or null) says; `prompt`: its
    `prompt_tokens`."""
    if details is not None and details.cached_tokens is not None:
        return CachedTokens(max(0, details.cached_tokens), "details", prompt)
    return CachedTokens(0, "usage", prompt)


def from_meta(cached: int | None, prompt: int | None = None) -> CachedTokens | None:
    return None if cached is None else CachedTokens(max(0, cached), "field", prompt)


def openai_cached(payload: bytes) -> CachedTokens | None:
    """A completions or chat answer (or one stream event)."""
    try:
        return from_usage(_openai.decode(payload).usage)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def generate_cached(payload: bytes) -> CachedTokens | None:
    """An SGLang `/generate` answer or stream event (a batch's first item)."""
    try:
        out = _generate_any.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if isinstance(out, list):
        if not out:
            return None
        out = out[0]
    m = out.meta_info
    return None if m is None else from_meta(m.cached_tokens, m.prompt_tokens)


def stream_cached(tail: bytes, *, generate: bool) -> CachedTokens | None:
    """What the end of a stream says: its last whole `data:` event with a usage object (or, on
    `/generate`, with a `meta_info` count); None when the end holds none."""
    marker = _META if generate else _USAGE
    read = generate_cached if generate else openai_cached
    end = len(tail)
    while end > 0:
        start = tail.rfind(b"data:", 0, end)
        if start < 0:
            return None
        payload = tail[start + 5 : end].strip()
        end = start
        if (
            payload.find(marker) >= 0 and payload[:1] == b"{" and payload[-1:] == b"}"
        ):  # (common/jsonbytes.py)
            got = read(payload)
            if got is not None:
                return got
    return None
