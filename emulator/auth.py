"""`--api-key`: the engines' own bearer-token check, with each engine's choice of open paths.

* SGLang (`add_api_key_middleware`, srt/utils): every path but `/health*` and `/metrics*` (and
  OPTIONS) asks for `Authorization: Bearer KEY`; without it a 401 `{"error": "Unauthorized"}`.
* vLLM (`AuthenticationMiddleware`, entrypoints/openai/api_server): only paths under `/v1` ask
  for it; `/health`, `/metrics`, `/abort_requests` and the rest stay open. The same 401 body.

The emulator's own control paths (`/emulator/...`) stay open on both, for tests to reach.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def api_key_middleware(engine: str, key: str, refused: Callable[[], None]) -> Middleware:
    """The check; `refused` is called for each request turned away (the emulator counts them)."""
    want = f"Bearer {key}"

    def guarded(path: str) -> bool:
        if path.startswith("/emulator/"):
            return False
        if engine == "vllm":
            return path.startswith("/v1")
        return not (path.startswith("/health") or path.startswith("/metrics"))

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.method != "OPTIONS"
            and guarded(request.path)
            and request.headers.get("Authorization") != want
        ):
            refused()
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check
