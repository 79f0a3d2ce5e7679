"""Which workers are the same server under different names (`localhost` and `127.0.0.1`, a DNS
name and its address): found by resolving each worker's host, so that one server is not
registered twice (it would get twice its share of the traffic and be counted as two).

Two DNS names that resolve to one address are not taken for one server: name-based virtual
hosts, an ingress or a CDN serve several behind one address and tell them apart by the Host
header and SNI, which the gateway sends. One of the two must be an address or `localhost`."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable
from typing import Protocol, TypeVar

RESOLVE_TIMEOUT_S = 2.0


class HasAddress(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...


W = TypeVar("W", bound=HasAddress)


def url_host(host: str) -> str:
    """A host as it is written in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def canonical_url(scheme: str, host: str, port: int) -> str:
    """A worker's URL as the gateway keys and shows it: `scheme://host:port`, port explicit."""
    return f"{scheme}://{url_host(host)}:{port}"


def _literal(host: str) -> bool:
    """An address, or `localhost`: a name that cannot stand for a virtual host."""
    if host.lower() == "localhost":
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _comparable(a: HasAddress, b: HasAddress) -> bool:
    return a.port == b.port and (_literal(a.host) or _literal(b.host))


async def addresses(host: str, port: int, timeout_s: float = RESOLVE_TIMEOUT_S) -> frozenset[tuple[str, int]]:
    """The (address, port) pairs `host`:`port` resolves to; empty when it does not resolve (in
    time): an unresolvable worker is the health checker's business, not a duplicate."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError):
        return frozenset()
    return frozenset((str(info[4][0]), int(info[4][1])) for info in infos)


async def same_server(new: HasAddress, others: Iterable[W]) -> tuple[W, tuple[str, int]] | None:
    """The first of `others` that resolves to an address `new` resolves to, and that address."""
    mine = await addresses(new.host, new.port)
    if not mine:
        return None
    for o in others:
        if not _comparable(new, o):
            continue
        shared = mine & await addresses(o.host, o.port)
        if shared:
            return o, min(shared)
    return None


async def first_duplicate(workers: Iterable[W]) -> tuple[W, W, tuple[str, int]] | None:
    """Two workers that resolve to a common address (the first such pair), or None."""
    items = list(workers)
    resolved = await asyncio.gather(*(addresses(w.host, w.port) for w in items))
    seen: dict[tuple[str, int], list[W]] = {}
    for w, addrs in zip(items, resolved, strict=True):
        for addr in sorted(addrs):
            for other in seen.get(addr, ()):
                if _comparable(other, w):
                    return other, w, addr
        for addr in addrs:
            seen.setdefault(addr, []).append(w)
    return None


def _loopback_or_any(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.0/8, ::1, 0.0.0.0, ::, and the IPv4 ones written as IPv6 (`::ffff:127.0.0.1`,
    the IPv4-mapped form, which Python's `is_loopback` does not see before 3.13, and the old
    IPv4-compatible `::127.0.0.1`): an address that reaches this machine itself."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif int(ip) >> 32 == 0 and int(ip) > 1:  # ::a.b.c.d (IPv4-compatible)
            ip = ipaddress.IPv4Address(int(ip))
    return ip.is_loopback or ip.is_unspecified


def _is_local(addr: str) -> bool:
    """Is `addr` one of this machine's own addresses (a socket can be bound to it)?"""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
    except OSError:
        return False
    return True


def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(addr.partition("%")[0])  # (without an IPv6 zone)
    except ValueError:
        return None


async def reaches_self(host: str, port: int, listening: Iterable[tuple[str, int]]) -> bool:
    """Would a worker at `host`:`port` be this gateway itself (a request loop)? `listening`: the
    (host, port) pairs the gateway listens on. Every spelling of an address counts as the address
    it resolves to (`localhost`, `127.1`, `2130706433`, `[::ffff:127.0.0.1]`, `[::1]`, a name of
    this host): any loopback or unspecified address, or one of this machine's addresses when
    the gateway listens on all of them, or the very address it listens on, on one of its ports."""
    hosts = [h for h, p in listening if p == port]
    if not hosts:
        return False
    resolved = {a for a, _ in await addresses(host, port)}
    literal = _ip(host.strip("[]"))
    if literal is not None:
        resolved.add(str(literal))
    own: set[str] = set()
    for h in hosts:
        own |= {a for a, _ in await addresses(h, port)}
    wildcard = any((ip := _ip(a)) is not None and ip.is_unspecified for a in own) or "" in hosts
    for a in resolved:
        ip = _ip(a)
        if ip is None:
            continue
        if _loopback_or_any(ip) or a in own or (wildcard and _is_local(a)):
            return True
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        if mapped is not None and (str(mapped) in own or (wildcard and _is_local(str(mapped)))):
            return True
    return False
