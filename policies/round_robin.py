"""`round_robin`: each role takes the next worker in id order after the one it routed to last.

Algorithm: candidates are sorted by worker id; the picker keeps, per (role, model), the id of
the last worker a `Routed` event reported for that role, and picks the first candidate whose id
sorts after it (wrapping around). Keeping an id rather than an index means workers joining,
leaving or being excluded never make it skip or repeat more than necessary.

Parameters: none. Worker `weight` is ignored. The cursor advances only in `observe(Routed)`,
so `plan()` stays a pure read: a caller that plans without reporting `Routed` gets the same
worker again.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import PolicyEvent, Profile, Routed
from policies.pd import PDPolicy
from policies.snapshot import RequestView, Role, WorkerState


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._last: dict[tuple[Role, str], str] = {}

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        # the next id after the last one picked, wrapping to the smallest (one pass, no sort)
        first = scored[0][0]
        last = self._last.get((first.role, req.model))
        after: WorkerState | None = None
        for w, _ in scored:
            wid = w.id
            if wid < first.id:
                first = w
            if last is not None and wid > last and (after is None or wid < after.id):
                after = w
        return after if after is not None else first

    observes = (Routed,)  # only routing moves the cursor

    def observe(self, event: PolicyEvent) -> None:
        if isinstance(event, Routed):
            last, model, roles = self._last, event.model, event.roles
            for i, wid in enumerate(event.worker_ids):
                last[(roles[i], model)] = wid


def round_robin_profile(name: str = "round_robin") -> Profile:
    return Profile(name=name, picker=RoundRobinPicker())


def make_policy() -> PDPolicy:
    """A whole round-robin policy (one cursor per role)."""
    return PDPolicy(
        "round_robin",
        decode=round_robin_profile(),
        prefill=round_robin_profile(),
        colocated=round_robin_profile(),
    )
