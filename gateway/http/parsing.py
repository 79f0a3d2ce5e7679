"""The httptools parser callbacks of a server connection: a request's head and body read, framed
and checked against the limits (a mixin of `gateway.http.connection.HttpConnection`)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

from httptools import (
    HttpRequestParser,
)

from .limits import ServerLimits
from .request import HttpRequest, _RequestError, _split_target, _StopParsing

if TYPE_CHECKING:
    from .responder import HttpResponder
    from .server import HttpServer

_METHODS: dict[bytes, str] = {
    m: m.decode() for m in (b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH")
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# the request header fields the server itself reads (on_header)
_FRAMING = frozenset((b"content-length", b"expect", b"transfer-encoding", b"host"))


class RequestParsing:
    """The parser callbacks (`HttpRequestParser(self)` calls them) and the checks of a request's
    head. The state they read and write lives in the connection's slots, declared here for the
    type checker."""

    # the state of the request being read (the connection's other slots: HttpConnection)
    __slots__ = (
        "_body_len",
        "_body_parts",
        "_content_length",
        "_continue_due",
        "_cur",
        "_expect",
        "_hdr_bytes",
        "_headers",
        "_hosts",
        "_idle_t0",
        "_in_headers",
        "_raw_hdr",
        "_req_t0",
        "_te",
        "_url",
    )

    _body_len: int
    _body_parts: list[bytes]
    _client: tuple[str, int] | None
    _content_length: bytes | None
    _continue_due: bool
    _cur: HttpRequest | None
    _expect: bytes | None
    _hdr_bytes: int
    _headers: list[tuple[bytes, bytes]]
    _hosts: int
    _idle_t0: float
    _in_headers: bool
    _limits: ServerLimits
    _loop: asyncio.AbstractEventLoop
    _parser: HttpRequestParser
    _queue: deque[Any]
    _raw_hdr: int
    _req_t0: float
    _reserved: bool
    _responder: HttpResponder | None
    _server: HttpServer
    _stop_parsing: bool
    _task: asyncio.Task[None] | None
    _te: bytes | None
    _transport: asyncio.Transport
    _url: bytes

    def on_message_begin(self) -> None:
        if self._stop_parsing:
            raise _StopParsing
        self._in_headers = True
        self._raw_hdr = 0
        self._hdr_bytes = 0
        self._url = b""
        self._headers = []
        self._content_length = None
        self._expect = None
        self._continue_due = False
        self._te = None
        self._hosts = 0
        self._body_parts = []
        self._body_len = 0
        self._idle_t0 = 0.0
        self._req_t0 = self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._hdr_bytes += len(url)
        if self._hdr_bytes > self._limits.max_header_bytes:
            raise _RequestError(414, "Request URI too long.", "uri_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        n = self._hdr_bytes + len(name) + len(value) + 4
        self._hdr_bytes = n
        if n > self._limits.max_header_bytes:
            raise _RequestError(431, "Request header fields too large.", "request_header_fields_too_large")
        name = name.lower()
        if name in _FRAMING:  # one set lookup for the many fields the server does not read
            if name == b"content-length":
                self._content_length = value
            elif name == b"expect":
                self._expect = value
            elif name == b"transfer-encoding":
                self._te = value if self._te is None else self._te + b"," + value
            else:
                self._hosts += 1
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_headers = False
        parser = self._parser
        mb = parser.get_method()
        method = _METHODS.get(mb) or mb.decode("latin-1")
        path, query = _split_target(self._url)
        version = parser.get_http_version()
        self._check_framing(version)
        keep_alive = parser.should_keep_alive()
        if self._reserved:
            if not path.startswith(self._limits.reserved_paths):
                raise _RequestError(
                    503, "Too many open connections; try again later.", "too_many_connections"
                )
            keep_alive = False  # one request: the slot is free again at once
        cl = self._content_length
        if cl is not None:
            self._check_length(cl, parser.should_upgrade())
        if self._expect is not None:
            self._expect_continue(self._expect, version)
        self._cur = HttpRequest(method, path, query, self._headers, b"", self._client, version, keep_alive)

    def _check_length(self, cl: bytes, upgrade: bool) -> None:
        """The Content-Length `cl` checked: a number, within the body limit, 0 on an upgrade."""
        try:
            n = int(cl)
        except ValueError:
            raise _RequestError(400, "Invalid Content-Length.", "bad_request") from None
        if n > self._limits.max_body_bytes:
            raise _RequestError(413, "Request body too large.", "request_too_large")
        if upgrade and cl != b"0":
            raise _RequestError(400, "Upgrade with a request body is not supported.", "bad_request")

    def _expect_continue(self, expect: bytes, version: str) -> None:
        """`Expect: 100-continue` answered (417 for any other expectation). Not inside another
        response: while one is being written (or requests wait before this one) the 100 is held
        back and sent when they are done (`_next`)."""
        if expect.lower() != b"100-continue":
            raise _RequestError(417, "Unsupported Expect header.", "expectation_failed")
        if version == "1.1":
            resp = self._responder
            if not self._queue and (self._task is None or (resp is not None and resp._finished)):
                self._transport.write(_CONTINUE)
            else:
                self._continue_due = True

    def _check_framing(self, version: str) -> None:
        """The request head's version, Host and Transfer-Encoding checked, and the server not
        shutting down: a `_RequestError` otherwise."""
        if version[0] > "1":
            raise _RequestError(
                505, f"HTTP/{version} is not supported; use HTTP/1.1.", "http_version_not_supported"
            )
        if self._hosts != 1 and (self._hosts or version == "1.1"):
            # RFC 9112 3.2: exactly one Host in HTTP/1.1 (at most one in 1.0); uvicorn, nginx
            # and Go's server answer the same 400
            what = "Missing" if not self._hosts else "Duplicate"
            raise _RequestError(400, f"{what} Host header.", "bad_request")
        te = self._te
        if te is not None and version == "1.0":
            # RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 message means faulty framing (1.0
            # has no chunked coding; a proxy between may frame it otherwise): what follows the
            # body cannot be trusted to be a request, so it is refused and the connection closed
            raise _RequestError(
                400, "Transfer-Encoding is not allowed in an HTTP/1.0 request.", "bad_request"
            )
        if te is not None and te.strip().lower() != b"chunked":
            # the parser frames `gzip, chunked` as chunked and would hand on the coded bytes
            raise _RequestError(
                501,
                f"Unsupported transfer coding {te.decode('latin-1')!r}; only chunked is accepted.",
                "not_implemented",
            )
        if self._server._draining:
            # a request that arrives while the server shuts down (on a keep-alive connection:
            # the listening socket is closed) is answered 503 and its connection closed, not
            # reset: the client learns why, and the refusal is logged through on_refusal
            raise _RequestError(503, "The server is shutting down.", "shutting_down")

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > self._limits.max_body_bytes:
            raise _RequestError(413, "Request body too large.", "request_too_large")
        self._body_parts.append(body)
