"""Fault injection: ``KIND[:FRACTION][,key=value...]``.

Kinds and where they act:

=========================  =====================================================================
``http_error``             answer ``status`` (default 500) in the engine's error shape at once
``hang_before_first_byte`` never send the status line (until the client goes away)
``hang_mid_stream``        send ``after`` tokens (default 2), then nothing more
``crash_mid_stream``       send ``after`` tokens (default 2), then drop the TCP connection
``error_mid_stream``       vLLM: send ``after`` tokens (default 2), then the engine's error event
                           (its engine core died) and ``[DONE]``; a whole answer is a 500
``slow``                   every token takes ``factor`` (default 5) times longer
``transfer_fail``          the KV transfer of the request fails (decode: 500 / SSE error)
``transfer_fail_concurrent`` fail transfers only while more than ``over`` (default 8) run at once
``transfer_stall``         the KV transfer never completes (the decode waits for its timeout)
``silent_truncation``      prefill ships a 1-token KV (SGLang #30233); SGLang prefill also answers
                           with its abort; the decode answers 200 with garbage
``abort_during_transfer``  SGLang #33507: the decode answers 200 with ``finish_reason`` length after
                           the first token
``stale_kv_params``        vLLM prefill returns the params of an earlier request (SGLang: ships the
                           KV of an earlier request)
``bogus_kv_params``        vLLM prefill returns block ids out of range (``mode=empty``: ``[[]]``,
                           ``mode=short``: one block) - SGLang: ships random bytes
``wrong_request_kv``       the KV server serves another request's KV for this one
``health_ok_but_hung``     requests hang, ``/health`` stays 200
``tie_flip``               vLLM decode with remote KV: where its first token's two best are
                           near-tied (``model.tie_gap``), it draws the runner-up (numerics that
                           differ between the legs; a correct answer, not a failure)
=========================  =====================================================================

``FRACTION`` (default 1.0) is the share of requests hit, drawn from a seeded RNG.
"""

from __future__ import annotations

import random

import msgspec

KINDS = frozenset(
    {
        "http_error",
        "hang_before_first_byte",
        "hang_mid_stream",
        "crash_mid_stream",
        "error_mid_stream",
        "slow",
        "transfer_fail",
        "transfer_fail_concurrent",
        "transfer_stall",
        "silent_truncation",
        "abort_during_transfer",
        "stale_kv_params",
        "bogus_kv_params",
        "wrong_request_kv",
        "health_ok_but_hung",
        "tie_flip",
    }
)


class FaultSpecError(ValueError):
    pass


class Fault(msgspec.Struct, frozen=True):
    kind: str
    fraction: float = 1.0
    params: dict[str, str] = {}
    spec: str = ""

    def get_float(self, key: str, default: float) -> float:
        v = self.params.get(key)
        return default if v is None else float(v)

    def get_int(self, key: str, default: int) -> int:
        v = self.params.get(key)
        return default if v is None else int(v)

    def get_str(self, key: str, default: str) -> str:
        return self.params.get(key, default)


def parse_fault(spec: str) -> Fault:
    text = spec.strip()
    if not text:
        raise FaultSpecError("empty fault spec")
    head, *rest = text.split(",")
    kind, _, frac = head.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    try:
        fraction = float(frac) if frac else 1.0
    except ValueError as e:
        raise FaultSpecError(f"bad fraction in {spec!r}") from e
    if not 0.0 <= fraction <= 1.0:
        raise FaultSpecError(f"fraction must be within [0, 1] in {spec!r}")
    params: dict[str, str] = {}
    for item in rest:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise FaultSpecError(f"bad key=value {item!r} in {spec!r}")
        params[key.strip()] = value.strip()
    return Fault(kind, fraction, params, text)


class FaultSet:
    """The active faults of one server, with a seeded RNG for the fractions."""

    def __init__(self, specs: list[str], seed: int = 0) -> None:
        self._rng = random.Random(seed ^ 0x5EED)
        self.faults: list[Fault] = []
        self.replace(specs)

    def replace(self, specs: list[str]) -> None:
        faults = [parse_fault(s) for s in specs]
        self.faults = faults

    @property
    def specs(self) -> list[str]:
        return [f.spec for f in self.faults]

    def has(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.faults)

    def draw(self) -> dict[str, Fault]:
        """The faults hitting one request (each kind drawn independently)."""
        if not self.faults:
            return {}
        hit: dict[str, Fault] = {}
        for f in self.faults:
            if f.fraction >= 1.0 or self._rng.random() < f.fraction:
                hit.setdefault(f.kind, f)
        return hit
