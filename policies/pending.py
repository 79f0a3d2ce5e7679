"""Requests a policy was told were routed and has not yet heard the end of, oldest first.

A cancelled request may never send its outcome, so both the cache-aware state and the cost-model
decider forget entries older than a horizon; `expire` is that sweep, shared.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, TypeVar


class Timed(Protocol):
    @property
    def at(self) -> float: ...


T = TypeVar("T", bound=Timed)


def expire(pending: OrderedDict[str, T], horizon: float) -> list[tuple[str, T]]:
    """Remove the entries routed at or before `horizon` and return them, oldest first (insertion
    order is routing order)."""
    gone: list[tuple[str, T]] = []
    while pending:
        rid, p = next(iter(pending.items()))
        if p.at > horizon:
            break
        del pending[rid]
        gone.append((rid, p))
    return gone
