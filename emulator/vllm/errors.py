"""vLLM's error answers: ``{"error": {message, type, param, code}}``, or a started stream's
error event and ``[DONE]``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from emulator.wire import end_sse, json_response, sse_error

ENGINE_DEAD_MSG = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class HandoffError(Exception):
    """The P/D handoff failed on the decode; `fatal`: its engine core died of it."""

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def error(status: int, message: str, typ: str | None = None, param: str | None = None) -> web.Response:
    typ = typ or (
        "BadRequestError" if status == 400 else "InternalServerError" if status >= 500 else "NotFoundError"
    )
    return json_response({"error": {"message": message, "type": typ, "param": param, "code": status}}, status)


def error_dict(status: int, message: str) -> dict[str, Any]:
    typ = "BadRequestError" if status == 400 else "InternalServerError"
    return {"error": {"message": message, "type": typ, "param": None, "code": status}}


async def failed(resp: web.StreamResponse | None, message: str) -> web.StreamResponse:
    """The engine failed the request: a 500, or a started stream's error event and [DONE]."""
    if resp is None:
        return error(500, message)
    await resp.write(sse_error(error_dict(500, message)))
    return await end_sse(resp)
