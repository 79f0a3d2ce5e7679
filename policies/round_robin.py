"""`round_robin`: each role takes the next worker in id order after the one it routed to last.

Algorithm: candidates are sorted by worker id; the picker keeps, per (role, model), the id of
the last worker a `Routed` event reported for that role, and picks the first candidate whose id
sorts after it (wrapping around). Keeping an id rather than an index means workers joining,
leaving or being excluded never make it skip or repeat more than necessary.

Parameters: none. Worker `weight` is ignored. The cursor advances only in `observe(Routed)`,
so `plan()` stays a pure read: a caller that plans without reporting `Routed` gets the same
worker again. A picker made for one role (`RoundRobinPicker(Role.DECODE)`, as
`round_robin_profile(role=...)` and `make_policy` make one per role) records only that role's
worker of each `Routed` event: the other roles' pickers record theirs, so the per-request record
is one store per picker, not one per role per picker. Without a role, it records every role:
one picker shared by all, as a policy built from the config has (`policies.build`; its cursors
are per role all the same, and a `Routed` event is one call to it, not one per role).
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import PolicyEvent, Profile, Routed
from policies.pd import PDPolicy
from policies.snapshot import RequestView, Role, WorkerState


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self, role: Role | None = None) -> None:
        self._last: dict[tuple[Role, str], str] = {}
        self._role = role  # None: record every role of a `Routed` event

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
            role, roles = self._role, event.roles
            if role is not None:  # its own role's worker only (a plan has each role at most once)
                if roles[0] is role:
                    self._last[(role, event.model)] = event.worker_ids[0]
                elif len(roles) > 1 and roles[1] is role:
                    self._last[(role, event.model)] = event.worker_ids[1]
                return
            last, model = self._last, event.model
            for i, wid in enumerate(event.worker_ids):
                last[(roles[i], model)] = wid


def round_robin_profile(name: str = "round_robin", role: Role | None = None) -> Profile:
    """A round-robin profile; `role`: the one role it selects for (None: any)."""
    return Profile(name=name, picker=RoundRobinPicker(role))


def make_policy() -> PDPolicy:
    """A whole round-robin policy (one cursor per role)."""
    return PDPolicy(
        "round_robin",
        decode=round_robin_profile(role=Role.DECODE),
        prefill=round_robin_profile(role=Role.PREFILL),
        colocated=round_robin_profile(role=Role.COLOCATED),
    )
