"""What the P/D decider's cost model (policies/cost_model.py) keeps of each routed request until
its outcome: what it booked, and its predicted decode window and stalls (`overlap`: how much of
a prefill that runs on its decode worker holds it; the cost model's docstring has the rule)."""

from __future__ import annotations


class Pending:
    """A routed request, until its outcome: what the model predicted and booked for it."""

    __slots__ = (
        "at",
        "booked",
        "decode",
        "dur",
        "kind",
        "max_tokens",
        "out",
        "prefill",
        "queued_s",
        "stall",
        "start",
        "step",
        "transfer_tokens",
        "work",
    )

    def __init__(self) -> None:
        self.at = 0.0
        self.booked = 0.0  # prefill seconds booked on its prefilling worker, until settled
        self.kind = ""  # "pd", "local" (a decode or colocated worker prefilling itself)
        self.prefill = ""  # the worker that prefills
        self.decode = ""  # the worker that decodes
        self.work = 0.0  # its prefill work (token-equivalents)
        self.queued_s = 0.0  # prefill seconds queued ahead of it on its prefilling worker
        self.transfer_tokens = 0
        self.out = 1  # output tokens expected
        self.max_tokens = 0
        self.start = 0.0  # when its decode is predicted to start (its first token)
        self.stall = 0.0  # predicted seconds of local prefill overlapping its decode so far
        self.dur = 0.0  # its predicted decode seconds without stalls
        self.step = 0.0  # its predicted time per token without stalls


class Decoder:
    """A worker that decodes: the requests routed to decode there."""

    __slots__ = ("running",)

    def __init__(self) -> None:
        self.running: dict[str, Pending] = {}


def overlap(start: float, end: float, r: Pending, chunk_s: float, running_at: float = 0.0) -> float:
    """The stall a prefill running over [start, end) in chunks of `chunk_s` puts on `r`'s decode:
    the part from its first token on, at most one chunk per token it has left when the prefill
    reaches it (its window, stretched by its stalls so far). `running_at`: a time `r` is known
    to be still running (its outcome has not come): its window lasts at least a step past it."""
    lo = start if start > r.start else r.start
    stop = r.start + r.dur + r.stall
    if running_at + r.step > stop:
        stop = running_at + r.step
    if end <= lo or lo >= stop:
        return 0.0
    span = end - lo
    if r.step > 0.0:
        cap = (stop - lo) / r.step * chunk_s
        if cap < span:
            return cap
    return span
