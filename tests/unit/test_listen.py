"""`gateway.listen.bind_all`: the one loop that binds the gateway's listening sockets (one
process's `Gateway.start` and the supervisor of `serve --workers N`), on real loopback sockets."""

from __future__ import annotations

import socket

import pytest

from gateway.listen import ListenError, bind_all


def _infos(*hosts: str, port: int = 0) -> list[tuple[object, ...]]:
    return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (h, port)) for h in hosts]


def test_port_0_is_one_port_on_every_address() -> None:
    # 127.0.0.1 and 127.0.0.2 are both loopback on Linux: two addresses of one "host"
    socks = bind_all(_infos("127.0.0.1", "127.0.0.2"), "two", 0, reuse_port=False)
    try:
        ports = {s.getsockname()[1] for s in socks}
        assert len(socks) == 2 and len(ports) == 1 and ports != {0}
    finally:
        for s in socks:
            s.close()


def test_a_taken_port_is_a_listen_error() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.2", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        with pytest.raises(ListenError, match=rf"cannot listen on two:{port}: Address already in use"):
            bind_all(_infos("127.0.0.1", "127.0.0.2", port=port), "two", port, reuse_port=False)
    finally:
        busy.close()


def test_no_address_is_a_listen_error() -> None:
    with pytest.raises(ListenError, match="cannot listen on none:80: no address"):
        bind_all([], "none", 80, reuse_port=False)


def test_repeated_addresses_are_bound_once() -> None:
    socks = bind_all(_infos("127.0.0.1", "127.0.0.1"), "dup", 0, reuse_port=True)
    try:
        assert len(socks) == 1
        assert socks[0].getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
    finally:
        for s in socks:
            s.close()
