"""A request as the server hands it to handlers (`HttpRequest`), a request the server refused
itself (`Refusal`), and the errors request parsing raises."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from httptools import (
    HttpParserError,
    parse_url,
)


class HttpRequest:
    """A complete request, built by the protocol and read by handlers."""

    __slots__ = (
        "_index",
        "body",
        "client",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        client: tuple[str, int] | None,
        http_version: str = "1.1",
        keep_alive: bool = True,
    ) -> None:
        self.method = method
        self.path = path  # without the query string, not percent-decoded
        self.query = query  # raw query string, "" if none
        self.headers = headers  # names lowercased, values as sent
        self.body = body
        self.client = client
        self.http_version = http_version
        self.keep_alive = keep_alive
        self._index: dict[bytes, bytes] | None = None

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lowercase), or None. The first call indexes the
        fields (in C: the later of two equal names is written first, so the first one wins); a
        request's handlers look up four to six names among the `openai` client's seventeen
        fields, each a scan of the list before. `headers` is not to be changed after that."""
        index = self._index
        if index is None:
            index = self._index = dict(reversed(self.headers))
        return index.get(name)

    def fields(self) -> dict[bytes, bytes]:
        """The index `header` reads (lowercase name: its first value), built on the first call:
        for a reader of several names, whose `.get` of each is then a call into C, not a frame."""
        index = self._index
        if index is None:
            index = self._index = dict(reversed(self.headers))
        return index

    def __repr__(self) -> str:
        return f"<HttpRequest {self.method} {self.path}>"


class _Err:
    __slots__ = ("code", "headers", "message", "status", "t0", "url")

    def __init__(self, status: int, message: str, code: str) -> None:
        self.status = status
        self.message = message
        self.code = code
        # what was read of the refused request (set by `HttpConnection._fail`)
        self.headers: list[tuple[bytes, bytes]] = []
        self.url = b""
        self.t0 = 0.0


class Refusal:
    """A request the server answered itself, with an error, before any handler saw it (413,
    431, 400, 408, 414, 417, 501, 505), as the `on_refusal` hook of :func:`start_server` gets it.

    ``headers``: the header fields read before the refusal (names lowercased; all of them when
    the head was complete, those complete so far otherwise, none when not even the request line
    was). ``path``: the request target's path as far as it was read ("" if none), not decoded.
    ``elapsed_s``: since the request's first byte (0 when none was read)."""

    __slots__ = ("_index", "client", "code", "elapsed_s", "headers", "message", "path", "status")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: list[tuple[bytes, bytes]],
        path: str,
        client: tuple[str, int] | None,
        elapsed_s: float,
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.path = path
        self.client = client
        self.elapsed_s = elapsed_s
        self._index: dict[bytes, bytes] | None = None

    # the first value of header ``name`` (lowercase) among those read, or None
    header = HttpRequest.header

    def __repr__(self) -> str:
        return f"<Refusal {self.status} {self.code} {self.path!r}>"


# the application's word on a refusal (log it, count it): more response headers to send with it
RefusalHook = Callable[[Refusal], Sequence[tuple[bytes, bytes]]]


def _target_path(url: bytes) -> str:
    """The path of a request target as far as it was read (origin or absolute form)."""
    if url[:1] != b"/" and b"://" in url:
        rest = url.partition(b"://")[2]
        slash = rest.find(b"/")
        url = rest[slash:] if slash >= 0 else b""
    for sep in (b"?", b"#"):
        i = url.find(sep)
        if i >= 0:
            url = url[:i]
    return url.decode("latin-1")


def _split_target(url: bytes) -> tuple[str, str]:
    """(path, query) of a request target: origin form (`/p?q#f`), `*`, or absolute form."""
    if url[:1] == b"/":
        q = url.find(b"?")
        if q < 0:
            h = url.find(b"#")
            return (url if h < 0 else url[:h]).decode("latin-1"), ""
        rest = url[q + 1 :]
        h = rest.find(b"#")
        return url[:q].decode("latin-1"), (rest if h < 0 else rest[:h]).decode("latin-1")
    if url == b"*":
        return "*", ""
    try:
        u = parse_url(url)
    except HttpParserError:
        raise _RequestError(400, "Malformed request target.", "bad_request") from None
    return (u.path or b"/").decode("latin-1"), (u.query or b"").decode("latin-1")


class _RequestError(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.err = _Err(status, message, code)


class _StopParsing(Exception):
    pass
