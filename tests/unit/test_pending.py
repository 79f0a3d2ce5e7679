"""`policies.pending.expire`: the sweep of routed requests whose outcome never came."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from policies.pending import expire


@dataclass
class _At:
    at: float


def test_expire_removes_the_old_entries_oldest_first_and_keeps_the_rest() -> None:
    pending = OrderedDict((rid, _At(at)) for rid, at in [("a", 1.0), ("b", 2.0), ("c", 3.0)])
    gone = expire(pending, 2.0)
    assert [(rid, p.at) for rid, p in gone] == [("a", 1.0), ("b", 2.0)]
    assert list(pending) == ["c"]


def test_expire_stops_at_the_first_young_entry_and_takes_nothing_from_an_empty_table() -> None:
    pending = OrderedDict([("a", _At(5.0)), ("b", _At(1.0))])  # routing order, not time order
    assert expire(pending, 2.0) == []
    assert list(pending) == ["a", "b"]
    assert expire(OrderedDict(), 10.0) == []
