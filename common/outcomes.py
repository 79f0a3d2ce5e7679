"""What one engine leg of a request came to: the record the gateway hands to breakers and, with
`Completed` and `Failed` events, to policies (`policies.base`).

A leg is one engine request of an attempt: the colocated worker's, or a handoff's prefill or
decode. Its `LegOutcome` says what the leg says of its worker; the breaker's verdict follows
from it (`LegOutcome.verdict`). Records are small frozen Structs, made once per leg when it ends
(gateway/orchestration/legs.py), so that whoever learns from outcomes (failure classification,
cost models, cache-hit feedback) reads one shape.
"""

from __future__ import annotations

import enum

import msgspec


class LegOutcome(enum.StrEnum):
    # the leg did its part (a prefill whose KV was handed over counts, whatever the decode did)
    DONE = "done"
    # the engine refused the request for the request's own fault (an engine's 4xx): the worker
    # is well, so its breaker counts it as a success
    REFUSED = "refused"
    # the leg failed, and the failure is held against its worker
    FAILED = "failed"
    # the leg failed or was cut short, but not by its worker's fault: the other leg's failure,
    # or the handoff's between the two (the pair's breaker counts that one)
    SPARED = "spared"
    # no verdict on the worker at all: the client went away, a sibling unit of a split request
    # failed, the gateway ran short of its own resources
    NO_VERDICT = "no_verdict"

    @property
    def verdict(self) -> bool | None:
        """The breaker's verdict: True (it did its part), False (its failure), None (none)."""
        return VERDICTS[self]


# each outcome's breaker verdict (as `LegOutcome.verdict`, a lookup without the property's call)
VERDICTS: dict[LegOutcome, bool | None] = {
    LegOutcome.DONE: True,
    LegOutcome.REFUSED: True,
    LegOutcome.FAILED: False,
    LegOutcome.SPARED: None,
    LegOutcome.NO_VERDICT: None,
}


class LegRecord(msgspec.Struct, frozen=True, gc=False):
    """One leg's end: which worker, in which role of the plan ("prefill", "decode" or
    "colocated"), its outcome, and the error code of the failure it ended with (None when it
    ended without one)."""

    worker_id: str
    role: str
    outcome: LegOutcome
    error: str | None = None


class Timings(msgspec.Struct, frozen=True, gc=False):
    """When the phases of the attempt that served a request ended, in seconds from the
    attempt's start (the moment it was planned), for whoever learns a cost model from outcomes
    (the P/D decider: prefill rates per worker, handoff cost per pair, time per output token).

    `prefill_s`: a P/D prefill's answer came (SGLang's once its KV was sent, vLLM's once its KV
    was ready to pull); None on a colocated plan. `first_token_s`: a stream's first bytes went to
    the client (its first token; after a handoff, once its KV came); None for a whole answer,
    whose first byte is its last. `end_s`: the answer's last byte. `chunks`: the upstream reads
    of a stream (about one per token event, fewer when events came together), 0 for a whole
    answer. `output_tokens`: the answer's own count where the gateway read one (a checked
    stream's usage, a whole answer's), else None."""

    end_s: float
    prefill_s: float | None = None
    first_token_s: float | None = None
    chunks: int = 0
    output_tokens: int | None = None

    @property
    def handoff_s(self) -> float | None:
        """From a P/D prefill's answer to the first token (the KV's transfer, the decode's queue
        and its first step), where both are known."""
        if self.prefill_s is None or self.first_token_s is None:
            return None
        return max(0.0, self.first_token_s - self.prefill_s)

    @property
    def decode_s(self) -> float | None:
        """From the first token to the last (a stream's)."""
        if self.first_token_s is None:
            return None
        return max(0.0, self.end_s - self.first_token_s)
