"""gateway/endpoints.py: which workers are one server under two names."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway import endpoints


@dataclass
class W:
    id: str
    host: str
    port: int


TABLE = {
    "a.example": {("10.0.0.5", 443)},
    "b.example": {("10.0.0.5", 443)},  # another virtual host on the same address (a CDN, an ingress)
    "10.0.0.5": {("10.0.0.5", 443)},
}


@pytest.fixture(autouse=True)
def resolver(monkeypatch: pytest.MonkeyPatch) -> None:
    async def addresses(host: str, port: int, timeout_s: float = 0.0) -> frozenset[tuple[str, int]]:
        return frozenset(TABLE.get(host, set()))

    monkeypatch.setattr(endpoints, "addresses", addresses)


async def test_two_names_on_one_address_are_two_virtual_hosts() -> None:
    assert await endpoints.first_duplicate([W("a", "a.example", 443), W("b", "b.example", 443)]) is None
    assert await endpoints.same_server(W("b", "b.example", 443), [W("a", "a.example", 443)]) is None


async def test_a_name_and_its_address_are_one_server() -> None:
    a, ip = W("a", "a.example", 443), W("ip", "10.0.0.5", 443)
    assert await endpoints.first_duplicate([W("b", "b.example", 443), a, ip]) == (
        W("b", "b.example", 443),
        ip,
        ("10.0.0.5", 443),
    )
    assert await endpoints.same_server(ip, [a]) == (a, ("10.0.0.5", 443))
