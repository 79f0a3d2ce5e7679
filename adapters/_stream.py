"""What both engines' streams look like where the gateway must look inside them: the events that
end a stream (a finish reason, an error event), the usage-only chunk, and a refusal sent as a
stream. Shared by the SGLang and vLLM adapters (and plain OpenAI-compatible servers), which
speak the same OpenAI stream shapes; SGLang's `/generate` adds its own finish-reason object."""

from __future__ import annotations

import msgspec

_SEP = b"\n\n"

# Both engines write compact JSON (orjson / pydantic): a finish reason that is set starts with a
# quote (OpenAI shapes) or a brace (SGLang's /generate); an unset one is `null`. Their error
# events too are compact on SGLang's /generate (orjson) but spaced on the OpenAI routes of both
# (`json.dumps`: `{"error": {`), which the compact marker's prefix matches as well.
STREAM_END_MARKERS = (b'"finish_reason":"', b'"finish_reason":{', b'{"error":')


class _UsageChunk(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: msgspec.Raw = msgspec.Raw(b"null")
    system_fingerprint: msgspec.Raw = msgspec.Raw()  # empty: absent


_usage_chunk = msgspec.json.Decoder(_UsageChunk)


def without_usage_chunk(events: bytes) -> bytes:
    """Whole events less the usage-only one (`"choices": []` and a usage), for a client that
    did not ask for it. What the engine would then have sent instead: vLLM stamps its system
    fingerprint on the stream's terminal chunks (those with a finish reason) when no usage chunk
    follows to carry it (completion/serving.py:425-432, chat_completion/serving.py:803-811), so
    the dropped chunk's fingerprint moves onto them."""
    out = []
    fingerprint = b""
    for event in events.split(_SEP):
        if event.find(b'"usage"') >= 0 and event.startswith(b"data:"):  # (`find`: common/jsonbytes.py)
            try:
                ev = _usage_chunk.decode(event[5:].strip())
            except msgspec.DecodeError:
                ev = None
            if ev is not None and not ev.choices and bytes(ev.usage) != b"null":
                fingerprint = bytes(ev.system_fingerprint)
                continue
        out.append(event)
    if fingerprint and fingerprint != b"null":
        for i, event in enumerate(out):
            if event.find(STREAM_END_MARKERS[0]) >= 0 and event.find(b'"system_fingerprint"') < 0:
                end = event.rfind(b"}")
                if event.startswith(b"data:") and end > 0:
                    out[i] = event[:end] + b',"system_fingerprint":' + fingerprint + event[end:]
    return _SEP.join(out)


def refused_in_stream(body: bytes) -> bool:
    """Is a streamed answer a refusal: one error event (SGLang's /generate refuses a streamed
    request so, with a 200)?"""
    return body.lstrip().startswith(b'data: {"error"')
