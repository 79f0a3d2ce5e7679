"""The gateway's listening sockets: bound to every address a host resolves to, not yet
listening (connections are refused until the server starts), with the options asyncio's
`create_server` sets. One process binds them for itself (`gateway.app`); the supervisor of
`serve --workers N` binds them once for the group (`gateway.multiprocess.supervisor`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable
from typing import Any


class ListenError(Exception):
    """The gateway cannot listen on `listen.host`:`listen.port` (the port is taken, the host does
    not resolve or is not this machine's). `Gateway.start` finds out before probing any worker."""


def listen_error(host: str, port: int, e: OSError) -> ListenError:
    return ListenError(f"cannot listen on {host}:{port}: {e.strerror or e}")


def bind_all(
    infos: Iterable[tuple[Any, ...]], host: str, port: int, *, reuse_port: bool
) -> list[socket.socket]:
    """A socket bound to each address of `infos` (`getaddrinfo`'s answer for `host`:`port`,
    repeats dropped); port 0: the one picked for the first address, the same on every other.
    `reuse_port`: SO_REUSEPORT, so that the gateway's processes each listen on the port.
    ListenError when one cannot be bound (the others are closed) or there is no address."""
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            try:
                sock.bind(addr)
            except OSError as e:
                raise listen_error(host, port, e) from None
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    if not socks:
        raise ListenError(f"cannot listen on {host}:{port}: no address")
    return socks


async def bind_host(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """`bind_all` for `host`, resolved without blocking the loop; the sockets are
    non-blocking, as the loop's server wants them."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(
            host or None, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as e:  # socket.gaierror
        raise listen_error(host, port, e) from None
    socks = bind_all(infos, host, port, reuse_port=reuse_port)
    for sock in socks:
        sock.setblocking(False)
    return socks
