"""Byte-level JSON body edits (the gateway's and the adapters'): splice keys in without re-encoding the rest."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

encoder = msgspec.json.Encoder()


def splice(body: bytes, extra: bytes) -> bytes:
    """Insert `"k":v,...` pairs (given without braces) before the object's closing brace."""
    if not extra:
        return body
    end = body.rstrip()
    if not end.endswith(b"}"):
        raise ValueError("body is not a JSON object")
    inner = end[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return inner + sep + extra + b"}"


def rewrite(
    fields: dict[str, msgspec.Raw], drop: Iterable[str] = (), set_: dict[str, bytes] | None = None
) -> bytes:
    """Re-encode a {key: raw} body with some keys dropped or replaced; other values stay byte for byte."""
    for k in drop:
        fields.pop(k, None)
    if set_:
        for k, v in set_.items():
            fields[k] = msgspec.Raw(v)
    return encoder.encode(fields)


_USAGE_ON = b'"stream_options":{"include_usage":true}'


def ask_stream_usage(body: bytes, *, keep_continuous: bool) -> bytes:
    """`body` (a streamed OpenAI-route request whose client did not ask for usage) asking for the
    usage chunk at the stream's end, its other `stream_options` kept. `continuous_usage_stats`
    is kept where the engine honours it without `include_usage` (SGLang: per-chunk usage either
    way), and dropped where `include_usage` is what turns it on (vLLM: `include_continuous_usage
    = include_usage and continuous_usage_stats`): asking for the end's usage must not make the
    engine add a usage to every chunk the client would not have had."""
    # (`find`, not `in`: on Python 3.11 `sub in some_bytes` first tries `sub` as an integer
    # and makes, formats and drops a TypeError, ~1,800 instructions; `find` does not)
    if body.find(b'"stream_options"') < 0:  # the usual case: no decode
        return splice(body, _USAGE_ON)
    fields: dict[str, msgspec.Raw] = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    raw = fields.get("stream_options")
    if raw is None:  # the name was inside a string
        return splice(body, _USAGE_ON)
    opts = msgspec.json.decode(raw)
    opts = dict(opts) if isinstance(opts, dict) else {}
    opts["include_usage"] = True
    if not keep_continuous:
        opts.pop("continuous_usage_stats", None)
    return rewrite(fields, set_={"stream_options": encoder.encode(opts)})


def pairs(**kv: bytes) -> bytes:
    """`"a":1,"b":"x"` from already-encoded JSON values."""
    return b",".join(b'"' + k.encode() + b'":' + v for k, v in kv.items())


def iter_sse_data(body: bytes) -> Iterable[bytes]:
    """The payloads of `data:` lines of an SSE body, `[DONE]` excluded."""
    for line in body.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if payload and payload != b"[DONE]":
                yield payload
