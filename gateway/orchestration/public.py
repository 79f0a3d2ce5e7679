"""What clients are told of failures (docs/operations.md, "What clients are told of failures").

A client never gets a worker's address or an engine's own words about a failure on its side:
those go to the gateway's log, and the client gets a stable sentence per error code with its
request id (`common.errors.GatewayError.detail` and `body`). An engine's refusal of the request
itself (a 4xx, or its streamed form) is the client's to read, and is passed on, unless its text
names an address (`screened`). Streams the gateway relays unwatched (a colocated worker's, a P/D
decode's with the guards off) are screened the same way, event by event, where a chunk carries
an error or an abort (`EventScreen`); a watched stream's engine errors never reach the client
(gateway/streamwatch.py holds them and the relay answers its own).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import msgspec

from common.errors import ErrorCode, GatewayError, UpstreamRejected, error_body, public_text
from gateway.logging import get_logger

log = get_logger("pd_gateway.request")

# an IPv4 address (with or without a port), a bracketed IPv6 one, a URL
_SHAPES = re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}\b|\[[0-9a-fA-F:.]+\]|://")
_TRACEBACK = "Traceback (most recent call last)"
_SEP = b"\n\n"
# what marks an event that may be an engine's error: an error object, an abort finish
MARKERS = (b'"error"', b'"abort"')


def names_internals(text: str, addresses: tuple[str, ...]) -> bool:
    """Does `text` name a worker (one of `addresses`), any network address, or quote a Python
    traceback?"""
    return _SHAPES.search(text) is not None or _TRACEBACK in text or any(a in text for a in addresses)


def screened(e: GatewayError, addresses: tuple[str, ...]) -> GatewayError:
    """`e` as its client may read it: an error whose public words name an address (an engine's
    refusal quoting one, say) gets its code's stable sentence instead; its detail is unchanged."""
    if e.internal or not names_internals(e.message, addresses):
        return e
    if isinstance(e, UpstreamRejected):
        e.message = f"the engine refused the request (HTTP {e.status})"
    else:
        e.message = public_text(e.code)
    return e


class _Finish(msgspec.Struct):
    type: str | None = None
    status_code: int | None = None
    message: str | None = None


class _Meta(msgspec.Struct):
    finish_reason: _Finish | str | None = None


class _ErrorDetail(msgspec.Struct):
    message: str | None = None
    type: str | None = None
    code: int | str | None = None


class _Event(msgspec.Struct):
    error: _ErrorDetail | str | None = None
    meta_info: _Meta | None = None
    # SGLang's flat error event on its OpenAI routes
    object: str | None = None
    message: str | None = None
    code: int | str | None = None


_event = msgspec.json.Decoder(_Event)


def _refusal(ev: _Event) -> tuple[str | None, bool]:
    """(the engine's words, whether they are a refusal of the request for its own fault: a
    4xx) of an error or abort event; (None, False) for any other event."""
    e = ev.error
    if isinstance(e, _ErrorDetail):
        code, text, kind = e.code, e.message, e.type or ""
    elif isinstance(e, str):
        code, text, kind = None, e, ""
    elif ev.object == "error":
        code, text, kind = ev.code, ev.message, ""
    elif ev.meta_info is not None and isinstance(ev.meta_info.finish_reason, _Finish):
        f = ev.meta_info.finish_reason
        if f.type != "abort":
            return None, False
        code, text, kind = f.status_code, f.message, ""
    else:
        return None, False
    try:
        status = int(code) if code is not None else 0
    except ValueError:
        status = 0
    client = 400 <= status < 500 or kind.lower().replace("_", "") in ("badrequesterror", "badrequest")
    return text or "", client


class EventScreen:
    """A stream's sink that replaces an engine's error or abort event by the gateway's own
    (stable words, the request id) unless it is the engine's refusal of the request naming no
    address; the engine's words go to the log. Per chunk: two substring tests."""

    __slots__ = ("_addresses", "_request_id", "_worker", "_write", "replaced")

    def __init__(
        self, write: Callable[[bytes], None], addresses: tuple[str, ...], request_id: str, worker: str
    ) -> None:
        self._write = write
        self._addresses = addresses
        self._request_id = request_id
        self._worker = worker
        self.replaced = 0

    def __call__(self, data: bytes) -> None:
        # (`partition`: a test as cheap as bytes have on Python 3.11, gateway/streamwatch.py)
        if data.partition(MARKERS[0])[1] or data.partition(MARKERS[1])[1]:
            data = self._screen(data)
        self._write(data)

    def _screen(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for event in data.split(_SEP):
            if event.startswith(b"data:") and (MARKERS[0] in event or MARKERS[1] in event):
                event = self._one(event)
            out.append(event)
        return _SEP.join(out)

    def _one(self, event: bytes) -> bytes:
        try:
            ev = _event.decode(event[5:].strip())
        except (msgspec.DecodeError, msgspec.ValidationError):
            return event  # not an object this screen reads (a token's text, say): as sent
        text, client = _refusal(ev)
        if text is None or (client and not names_internals(text, self._addresses)):
            return event
        self.replaced += 1
        log.warning(
            "request.engine_error_screened",
            request_id=self._request_id,
            worker=self._worker,
            error=text[:500],
        )
        message = (
            f"{public_text(ErrorCode.UPSTREAM_ERROR)} (request id {self._request_id}; "
            "the gateway's log has the details)"
        )
        return b"data: " + error_body(message, "server_error", ErrorCode.UPSTREAM_ERROR.value)
