"""The data policies read: frozen views of the cluster and of one request, and the plans they return.

Everything here is a frozen msgspec Struct. The gateway's registry builds a new
`ClusterSnapshot` when something changes (a probe, a scrape, a request starting or ending);
policies only read it. Nothing in this module does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from common.workers import Engine, Role, RouteKind, WorkerLoad, WorkerState

if TYPE_CHECKING:
    from policies.prompt_key import PromptKey

__all__ = [
    "LAYOUT_FIELDS",
    "ClusterSnapshot",
    "Colocated",
    "Disaggregated",
    "Engine",
    "Layout",
    "Plan",
    "Reject",
    "RequestView",
    "Role",
    "RouteKind",
    "WorkerLoad",
    "WorkerState",
    "same_layout",
]


class Layout:
    """A token that two snapshots share iff their workers are the same workers, in the same
    order, with the same `LAYOUT_FIELDS` (only their in-flight counts and load may differ): a
    policy may then keep what it derived from those fields (a split of the pool by role) and
    index the new snapshot's workers by position. Compared by identity."""

    __slots__ = ()


# what a policy may keep across snapshots of one `Layout`
LAYOUT_FIELDS = (
    "id",
    "role",
    "engine",
    "model",
    "healthy",
    "draining",
    "block_size",
    "labels",
    "decode_alone",
)


def same_layout(a: Sequence[WorkerState], b: Sequence[WorkerState]) -> bool:
    """Are `a` and `b` the same workers in the same order with the same `LAYOUT_FIELDS`?"""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if (
            x.id != y.id
            or x.role is not y.role
            or x.engine is not y.engine
            or x.model != y.model
            or x.healthy != y.healthy
            or x.draining != y.draining
            or x.block_size != y.block_size
            or x.labels != y.labels
            or x.decode_alone != y.decode_alone
        ):
            return False
    return True


class ClusterSnapshot(msgspec.Struct, frozen=True):
    version: int
    workers: tuple[WorkerState, ...]
    # shared by the snapshots whose workers have the same layout (`Layout`); None: unknown (a
    # policy derives everything from this snapshot alone)
    layout: Layout | None = None

    def pool(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> tuple[WorkerState, ...]:
        """Usable workers of `role` serving `model`, minus the excluded ids."""
        return tuple(
            w for w in self.workers if w.role is role and w.usable and w.serves(model) and w.id not in exclude
        )

    def get(self, worker_id: str) -> WorkerState | None:
        for w in self.workers:
            if w.id == worker_id:
                return w
        return None

    def models(self) -> tuple[str, ...]:
        return tuple(sorted({w.model for w in self.workers if w.model is not None}))


class RequestView(msgspec.Struct, frozen=True, gc=False):
    """Only what routing needs, computed once per request by the gateway."""

    request_id: str
    model: str
    route: RouteKind
    prompt_tokens: int  # exact with a tokenizer, else a conservative estimate
    max_tokens: int
    stream: bool = False
    n: int = 1
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of fixed-size prompt blocks
    session_key: str | None = None
    greedy: bool = False
    # the prompt for prefix matching (token ids, else canonical text); None: not keyed (a
    # batch, or a request path that does not key requests) -- see policies/prompt_key.py
    prompt_key: PromptKey | None = None


# ---- plans -------------------------------------------------------------------------------


class Colocated(msgspec.Struct, frozen=True, tag="colocated"):
    """One worker runs both phases (a colocated worker, or a decode worker doing its own prefill)."""

    worker: WorkerState
    reason: str = ""


class Disaggregated(msgspec.Struct, frozen=True, tag="disaggregated"):
    prefill: WorkerState
    decode: WorkerState
    reason: str = ""


class Reject(msgspec.Struct, frozen=True, tag="reject"):
    """No plan is possible. `status` is the HTTP status the gateway answers with."""

    reason: str
    status: int = 503


Plan = Colocated | Disaggregated | Reject
