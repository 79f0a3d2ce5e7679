"""Limits the HTTP server enforces on every connection."""

from __future__ import annotations

import msgspec


class ServerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Per-connection limits of :class:`gateway.http.server.HttpServer`.

    - ``max_body_bytes``: request bodies above this are answered 413 (checked against
      Content-Length before the body is read, and while a chunked body arrives).
    - ``max_header_bytes``: request line + headers above this are answered 431.
    - ``read_timeout_s``: a request must be received completely within this many seconds of its
      first byte, else 408.
    - ``keepalive_timeout_s``: an idle keep-alive connection is closed after this many seconds.
    - ``max_pipelined``: reading from a client is paused while this many complete requests are
      queued behind the one being handled.
    - ``backlog``: listen backlog.
    - ``client_stall_s``: a client that takes no byte of what is written to it for this long,
      while the server's writes to it are paused (its transport's buffer above high water), is
      cut: the connection is aborted, which cancels the handler in flight as a disconnect does,
      and the server's ``on_stall`` hook is told. A client that reads, however slowly, is not
      cut. 0: never.
    - ``max_connections``: open client connections at most (0: no limit). A connection past it
      is answered a 503 ``too_many_connections`` at once and closed, before anything is read.
    - ``reserved_connections``: the last this many of ``max_connections`` are kept for requests
      whose path starts with one of ``reserved_paths`` (health checks, metrics, the admin API):
      a connection accepted while fewer than this many slots are left serves one such request
      and closes (anything else is a 503 ``too_many_connections``), and is closed after
      ``reserved_timeout_s`` idle or reading. So a client holding every ordinary slot (idle
      keep-alive connections, slow uploads) still leaves room for the load balancer's probes.
    """

    max_body_bytes: int = 64 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    read_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    max_pipelined: int = 32
    backlog: int = 2048
    client_stall_s: float = 0.0
    max_connections: int = 0
    reserved_connections: int = 0
    reserved_paths: tuple[str, ...] = ()
    reserved_timeout_s: float = 5.0
