"""HTTP answer helpers both engine surfaces share: JSON bodies, SSE framing, hangs and crashes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
from aiohttp import web

JSON = "application/json"
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type=JSON)


async def hang_forever() -> None:
    await asyncio.Event().wait()


async def start_sse(request: web.Request, extra_headers: dict[str, str] | None = None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={"Content-Type": SSE_CONTENT_TYPE, **(extra_headers or {})})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    return resp


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def sse_error(obj: Any) -> bytes:
    """An error event of an OpenAI route, spaced as both engines write it (`json.dumps` in
    their `create_streaming_error_response`; their other events are compact)."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def end_sse(resp: web.StreamResponse) -> web.StreamResponse:
    """`[DONE]` and the end of the stream."""
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def crash(request: web.Request) -> None:
    """Drop the client connection now (``crash_mid_stream``)."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    raise ConnectionResetError("crash_mid_stream")
