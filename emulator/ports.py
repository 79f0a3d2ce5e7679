"""Free loopback ports for servers this project starts (emulators, gateways, routers; in the
emulator package because it imports nothing of ours, and bench and the tests may import it).

A port is free only a moment ago: another process may bind it before the caller does. Several
ports picked one by one can also come back equal, since each probe socket is closed before the
next is bound; `free_ports` holds every probe open until all are picked, so the ports it returns
are distinct."""

from __future__ import annotations

import socket

HOST = "127.0.0.1"


def free_ports(n: int, host: str = HOST) -> list[int]:
    """`n` distinct ports that were free a moment ago (all held open while picking)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = HOST) -> int:
    """One port that was free a moment ago (for several at once, `free_ports`)."""
    return free_ports(1, host)[0]
