"""SGLang's bootstrap server (runs on the prefill's ``--bootstrap-port``) and the decode's client.

Routes: ``PUT /route`` (a prefill rank registers ``rank_ip``/``rank_port`` and its layout),
``GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=`` (all ``-1``:
the parallel layout; otherwise one rank's ``{rank_ip, rank_port}``; 503 until registered, 400
on missing inputs, 404 on an unknown rank), ``GET /health`` -> ``OK``.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web

_QUERY_KEYS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


class BootstrapServer:
    def __init__(self) -> None:
        self.layout: dict[str, Any] | None = None
        self.ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self.app = web.Application()
        self.app.router.add_route("PUT", "/route", self._put_route)
        self.app.router.add_route("GET", "/route", self._get_route)
        self.app.router.add_route("GET", "/health", self._health)
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else port

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _put_route(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if not isinstance(body, dict) or "rank_ip" not in body or "rank_port" not in body:
            return web.Response(status=400, text="Missing rank_ip or rank_port")
        if self.layout is not None and body.get("decode_allocation_policy", "early") != self.layout.get(
            "decode_allocation_policy", "early"
        ):
            return web.Response(status=400, text="decode_allocation_policy mismatch")
        key = (
            int(body.get("attn_dp_rank", 0)),
            int(body.get("attn_cp_rank", 0)),
            int(body.get("attn_tp_rank", 0)),
            int(body.get("pp_rank", 0)),
        )
        self.ranks[key] = {"rank_ip": body["rank_ip"], "rank_port": int(body["rank_port"])}
        self.layout = {
            "attn_tp_size": int(body.get("attn_tp_size", 1)),
            "attn_cp_size": int(body.get("attn_cp_size", 1)),
            "dp_size": int(body.get("attn_dp_size", 1)),
            "pp_size": int(body.get("pp_size", 1)),
            "page_size": int(body.get("page_size", 1)),
            "kv_cache_dtype": body.get("kv_cache_dtype", "auto"),
            "follow_bootstrap_room": True,
            "prefill_http_port": body.get("prefill_http_port"),
            "decode_allocation_policy": body.get("decode_allocation_policy", "early"),
        }
        return web.Response(text="OK")

    async def _get_route(self, request: web.Request) -> web.Response:
        q = request.query
        if any(k not in q for k in _QUERY_KEYS):
            return web.Response(status=400, text="Missing inputs for bootstrap server.")
        try:
            dp, cp, tp, pp = (int(q[k]) for k in _QUERY_KEYS)
        except ValueError:
            return web.Response(status=400, text="Invalid inputs for bootstrap server.")
        if self.layout is None:
            return web.Response(status=503, text="Prefill server not fully registered yet.")
        if (dp, cp, tp, pp) == (-1, -1, -1, -1):
            return _json(self.layout)
        info = self.ranks.get((dp, cp, tp, pp))
        if info is None:
            return web.Response(status=404, text="Rank not found")
        return _json(info)


def url_host(host: str) -> str:
    """A host as it is written in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


async def register_rank(session: aiohttp.ClientSession, bootstrap: str, info: dict[str, Any]) -> None:
    async with session.put(f"http://{bootstrap}/route", data=msgspec.json.encode(info)) as resp:
        resp.raise_for_status()


async def resolve_rank(session: aiohttp.ClientSession, host: str, port: int) -> tuple[str, int]:
    """The decode's handshake: layout, then rank 0's address (what the decode then talks to)."""
    base = f"http://{url_host(host)}:{port}/route"
    timeout = aiohttp.ClientTimeout(total=2.0)
    layout_q = dict.fromkeys(_QUERY_KEYS, "-1")
    async with session.get(base, params=layout_q, timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"bootstrap {host}:{port} answered {resp.status}")
        await resp.read()
    rank_q = dict.fromkeys(_QUERY_KEYS, "0")
    async with session.get(base, params=rank_q, timeout=timeout) as resp:
        if resp.status != 200:
            raise RuntimeError(f"bootstrap {host}:{port} answered {resp.status}")
        info = msgspec.json.decode(await resp.read())
    return str(info["rank_ip"]), int(info["rank_port"])
