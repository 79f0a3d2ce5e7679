"""SGLang's error answers: `/generate`'s and the OpenAI routes' shapes."""

from __future__ import annotations

from aiohttp import web

from emulator.wire import json_response


def error_generate(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status=status)


def error_openai(status: int, message: str, typ: str | None = None) -> web.Response:
    typ = typ or ("BadRequestError" if status == 400 else str(status))
    return json_response(
        {"object": "error", "message": message, "type": typ, "param": None, "code": status}, status
    )


def max_tokens_error(value: int) -> web.Response:
    """SGLang's CompletionRequest validator (a pydantic error turned into a 400)."""
    err = {
        "type": "value_error",
        "loc": ("body", "max_tokens"),
        "msg": "Value error, max_tokens must be positive",
        "input": value,
        "ctx": {"error": ValueError("max_tokens must be positive")},
    }
    return error_openai(400, f"1 validation error:\n  {err} {[err]}", "Bad Request")
