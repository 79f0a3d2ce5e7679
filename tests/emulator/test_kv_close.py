"""A KV-transfer connection closed while a read waits must not suspend again.

When the event loop goes away with a decode's KV read still pending (a test's cluster stopped
mid-transfer), the garbage collector closes the read's coroutine: `GeneratorExit` is thrown in
at its `await`. A `finally` that then awaits the connection's close suspends a coroutine being
closed, and Python reports "coroutine ignored GeneratorExit" as an unraisable exception (seen
once as a warning of tests/faults/test_load_accounting.py). The coroutine is driven by hand
here, as a task would drive it, and closed where the collector would close it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from emulator.kvclient import _request
from emulator.kvtransfer import KvServer


async def _drive_until_blocked(coro: Coroutine[Any, Any, Any]) -> None:
    """Step `coro` as a task would until the future it waits on does not complete."""
    while True:
        fut = coro.send(None)
        done, _ = await asyncio.wait({fut}, timeout=0.3)
        if not done:
            return


class _Silent:
    """A TCP server that accepts and never answers; `pairs` are its (reader, writer) ends."""

    def __init__(self) -> None:
        self.pairs: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> int:
        async def keep(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.pairs.append((reader, writer))

        self.server = await asyncio.start_server(keep, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def __aexit__(self, *exc: object) -> None:
        for _, w in self.pairs:
            w.close()
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_a_pending_read_closed_at_collection_does_not_suspend() -> None:
    silent = _Silent()
    async with silent as port:
        coro = _request("127.0.0.1", port, {"op": "read"}, None)
        await _drive_until_blocked(coro)
        assert silent.pairs, "the read never reached the server"
        coro.close()  # raised RuntimeError("coroutine ignored GeneratorExit") before the fix


def _kv_server() -> KvServer:
    return KvServer(
        engine_id="e",
        read_blocks=lambda ids: None,
        pad_for=lambda n: 0,
        link_delay=lambda n: 0.0,
        release=lambda ids: None,
        on_transfer=lambda ok, n, s: None,
        concurrency_fault=lambda n: False,
    )


async def test_a_server_connection_closed_at_collection_does_not_suspend() -> None:
    silent = _Silent()
    async with silent as port:
        _, client = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(50):
                if silent.pairs:
                    break
                await asyncio.sleep(0.01)
            reader, writer = silent.pairs[0]
            coro = _kv_server()._handle(reader, writer)  # waits for a request that never comes
            await _drive_until_blocked(coro)
            coro.close()
        finally:
            client.close()
