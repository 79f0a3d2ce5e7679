"""The data plane: an HTTP/1.1 server and an upstream client pool on raw asyncio Protocols +
httptools. See docs/architecture.md."""

from .client import Batching, FlowControl, UpstreamPool, UpstreamResponse
from .errors import UpstreamConnectError, UpstreamError, UpstreamProtocolError, error_body
from .limits import ServerLimits
from .server import (
    Handler,
    HttpRequest,
    HttpResponder,
    HttpServer,
    Refusal,
    RefusalHook,
    StallHook,
    start_server,
)

__all__ = [
    "Batching",
    "FlowControl",
    "Handler",
    "HttpRequest",
    "HttpResponder",
    "HttpServer",
    "Refusal",
    "RefusalHook",
    "ServerLimits",
    "StallHook",
    "UpstreamConnectError",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "error_body",
    "start_server",
]
