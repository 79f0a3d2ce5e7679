"""The gateway's cap on open client connections (`limits.max_connections`), its reserve for
health checks and the admin API (`limits.reserved_connections`), and the configurable keep-alive
timeout (`limits.keepalive_timeout_s`), on raw sockets."""

from __future__ import annotations

import asyncio
import json
import time

from gateway.config import LimitsConfig
from tests.http._util import is_closed, read_response
from tests.integration.conftest import build_cluster, stop_cluster

COMPLETION = json.dumps({"model": "m-colocated", "prompt": "hi", "max_tokens": 2}).encode()
POST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(COMPLETION), COMPLETION)
)
HEALTH = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"


async def test_connections_past_the_limit_are_refused_and_the_reserve_serves_health_only() -> None:
    c = await build_cluster(limits=LimitsConfig(max_connections=12, reserved_connections=3))
    held: list[asyncio.StreamWriter] = []
    try:
        port = c.gateway.port
        # nine ordinary connections (12 - 3 reserved), each used once and kept open, idle
        readers = []
        for _ in range(9):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(POST)
            assert (await read_response(r)).status == 200
            readers.append(r)
            held.append(w)
        assert c.gateway.server is not None and c.gateway.server.connections == 9
        # the reserve: generation is refused at once...
        r, w = await asyncio.open_connection("127.0.0.1", port)
        held.append(w)
        w.write(POST)
        refused = await read_response(r)
        assert refused.status == 503 and refused.header(b"connection") == b"close"
        assert refused.header(b"retry-after") == b"1"
        assert json.loads(refused.body)["error"]["code"] == "too_many_connections"
        # ...a health check is answered, and its slot freed at once (Connection: close)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        held.append(w)
        w.write(HEALTH)
        ok = await read_response(r)
        assert ok.status == 200 and ok.header(b"connection") == b"close"
        assert await is_closed(r)
        # every slot taken (the refused one lingers a moment, reading what its client still
        # sends, and two idle connections in the reserve): the next one is answered 503 before it
        # sends a byte, and closed
        for _ in range(2):
            _, w = await asyncio.open_connection("127.0.0.1", port)
            held.append(w)
        await asyncio.sleep(0.05)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        held.append(w)
        full = await asyncio.wait_for(read_response(r), 5)
        assert full.status == 503 and json.loads(full.body)["error"]["code"] == "too_many_connections"
        assert await is_closed(r)
        # the ordinary connections still serve
        held[0].write(POST)
        assert (await read_response(readers[0])).status == 200
        metrics = c.gateway.metrics.render().decode()
        assert "pdgw_connections_refused_total 1.0" in metrics, metrics
        assert "pdgw_max_connections 12.0" in metrics
    finally:
        for w in held:
            w.close()
        await stop_cluster(c)


async def test_keep_alive_timeout_is_configurable() -> None:
    c = await build_cluster(limits=LimitsConfig(keepalive_timeout_s=0.4))
    try:
        r, w = await asyncio.open_connection("127.0.0.1", c.gateway.port)
        w.write(HEALTH)
        assert (await read_response(r)).status == 200
        t0 = time.monotonic()
        assert await is_closed(r, timeout=3.0)
        assert 0.3 < time.monotonic() - t0 < 1.5
        w.close()
    finally:
        await stop_cluster(c)


async def test_the_default_limit_is_below_the_open_files_limit() -> None:
    import resource

    c = await build_cluster()
    try:
        assert c.gateway.server is not None
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        most = c.gateway.server.limits.max_connections
        assert 0 < most <= soft // 2 and most <= 65536
        assert c.gateway.server.limits.keepalive_timeout_s == 75.0
    finally:
        await stop_cluster(c)
