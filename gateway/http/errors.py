"""Errors of the data plane and the OpenAI-shaped JSON error body."""

from __future__ import annotations

import msgspec


class UpstreamError(Exception):
    """Base class of the upstream client's errors."""


class UpstreamConnectError(UpstreamError):
    """The request never reached the upstream: connect refused/failed/timed out, or the pool
    is closed. Safe to retry elsewhere."""


class LocalResourceError(UpstreamConnectError):
    """This process could not open another upstream connection for want of its own resources
    (file descriptors, ephemeral ports, socket buffers, memory): no fault of the upstream."""


class UpstreamProtocolError(UpstreamError):
    """The upstream answered garbage, or closed the connection mid-response (or before any
    response byte on a fresh connection: the request may have been processed)."""


class _ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class _ErrorBody(msgspec.Struct):
    error: _ErrorDetail


_encode = msgspec.json.Encoder().encode


def error_body(
    message: str, *, type: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> bytes:
    """``{"error":{"message":...,"type":...,"param":...,"code":...}}`` as JSON bytes."""
    return _encode(_ErrorBody(_ErrorDetail(message, type, param, code)))
