"""What both ends of the data plane do with a new connection's transport."""

from __future__ import annotations

import asyncio
import socket
from typing import cast


def adopt(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """The connection's transport, with Nagle's algorithm off (a response head or a streamed
    chunk goes out at once, not after the peer's delayed ACK)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass
    # uvloop's transports implement asyncio.Transport without subclassing it
    return cast(asyncio.Transport, transport)
