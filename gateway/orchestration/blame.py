"""Who failed: the client, the prefill, the decode, the handoff between them, or no one.

Pure functions of an attempt's failure, with no I/O and no state, so each rule has its own table
of cases (tests/unit/test_blame.py):

- `fault_of`: which worker a failed handoff is held against, or whether it is the handoff's
  between the two (the pair's breaker counts it), or provoked by the request (no breaker does);
- `leg_outcome`: what one leg's end says of its worker (`LegOutcome`, whose `verdict` its breaker
  records), from whether it did its part, the failure it ended with, and how it is accountable;
- `exclusions`: what the next attempt must avoid;
- `leg_failure`, `upstream_status_error`, `prefill_error`, `prefill_refusal`: the error a failed
  engine call is to the request.
"""

from __future__ import annotations

import enum

from adapters import PrefillVerdict
from common.errors import (
    BadRequest,
    GatewayError,
    KVIntegrityError,
    PrefillFailed,
    ShortOfResources,
    UpstreamFailure,
    UpstreamRejected,
    UpstreamTimeout,
)
from common.outcomes import LegOutcome
from gateway.http.errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError
from policies.base import pair_id


class LegShape(enum.Enum):
    """How a leg runs, which decides the failures it answers for."""

    # the only engine working on the attempt while it runs (a colocated worker, a vLLM prefill):
    # every failure of the leg is its worker's (a request's own deadline included)
    ALONE = "alone"
    # a leg of an SGLang handoff, running beside the other: held only to failures that name it,
    # and a prefill with no verdict in time may be waiting for a decode that does not take its KV
    CONCURRENT = "concurrent"
    # a vLLM decode, after its prefill: held only to failures that name it
    SEQUENTIAL = "sequential"


class Fault(enum.Enum):
    """Whose fault a failed handoff is."""

    NONE = "none"  # not an engine's failure (the client left, a deadline, a refusal)
    WORKER = "worker"  # one worker's (`fault_of` names it)
    HANDOFF = "handoff"  # the handoff's between the two: the pair's breaker counts it
    PROVOKED = "provoked"  # the request may have provoked it: served by the next rung, counted by no breaker


class DecodeUnreached(UpstreamFailure):
    """A vLLM decode leg that never reached its decode (connect failed, pool closed): the
    prefill's KV is untouched and another decode may take it (gateway/orchestration/sequential.py)."""


def culprit(e: UpstreamFailure, *, concurrent: bool) -> str | None:
    """The worker a failed handoff is held against in its breaker, or None when the failure is
    of the handoff between the two (the pair breaker counts it): a failed integrity check, a
    decode that answered with a failure (a KV transfer that failed looks so), and, where both
    legs run at once (SGLang), a prefill with no verdict in time (it may be waiting for a decode
    that does not take its KV)."""
    if isinstance(e, KVIntegrityError) or (e.answered and e.phase == "decode"):
        return None
    if concurrent and isinstance(e, UpstreamTimeout) and e.phase == "prefill":
        return None
    return e.worker


def fault_of(e: BaseException | None, *, concurrent: bool) -> tuple[Fault, str | None]:
    """(whose fault, the worker it names) of a handoff that ended with `e`. A failure the
    request itself may have provoked (a prefill refused what its decode took: a limit below the
    decode's, or a decode slow to refuse) may be served by the next rung, but no breaker, the
    pair's included, counts it: clients would open them."""
    if not isinstance(e, UpstreamFailure):
        return Fault.NONE, None
    worker = culprit(e, concurrent=concurrent)
    if worker is not None:
        return Fault.WORKER, worker
    if e.instead is not None:
        return Fault.PROVOKED, None
    return Fault.HANDOFF, None


def is_client_fault(e: BaseException | None) -> bool:
    """Did the engine refuse the request for the request's own fault (an engine's 4xx, a
    refused prefill)? The gateway's own shortage of resources is no one's fault."""
    return isinstance(e, GatewayError) and not e.retryable and not isinstance(e, ShortOfResources)


def held_against(worker_id: str, e: BaseException | None, shape: LegShape) -> bool:
    """Is the failure `e` its worker's, for a leg that runs as `shape`?"""
    if shape is LegShape.ALONE:
        return True
    fault, worker = fault_of(e, concurrent=shape is LegShape.CONCURRENT)
    return fault is Fault.WORKER and worker == worker_id


def leg_outcome(*, done: bool, error: BaseException | None, blamed: bool, unjudged: bool) -> LegOutcome:
    """What one leg's end says of its worker. A leg that did its part, or whose engine refused the
    request for the request's own fault, is well; a request that ended without a verdict (the
    client went away, or a sibling unit of a split request failed: that says nothing of a worker,
    and counting it as a success closed half-open breakers on hung workers) counts for no one;
    otherwise the failure is the worker's when it is `blamed` for it, else no verdict on it
    (another leg failed first). A request's own deadline is still a verdict."""
    if done:
        return LegOutcome.DONE
    if is_client_fault(error):
        return LegOutcome.REFUSED
    if unjudged:
        return LegOutcome.NO_VERDICT
    return LegOutcome.FAILED if blamed else LegOutcome.SPARED


def pair_outcome(
    *, decode_done: bool, error: BaseException | None, unjudged: bool, concurrent: bool
) -> tuple[LegOutcome, bool]:
    """(the pair's outcome for its breaker, whether the failure is the handoff's between the two
    workers: then the workers whose own leg did not go well are suspects, `Registry.record_pair`).
    A provoked failure counts for no breaker."""
    fault, _ = fault_of(error, concurrent=concurrent)
    if fault is Fault.PROVOKED:
        return LegOutcome.NO_VERDICT, False
    outcome = leg_outcome(done=decode_done, error=error, blamed=True, unjudged=unjudged)
    return outcome, fault is Fault.HANDOFF


def exclusions(ran: tuple[str, ...], e: UpstreamFailure) -> set[str]:
    """Ids to exclude from the next attempt, from the workers the attempt ran on (prefill and
    decode, or the colocated one): the failed worker, or the pair when the link failed."""
    if len(ran) == 2:
        pair = pair_id(ran[0], ran[1])
        # a bad handoff (a decode that answered with a transfer failure is up): both workers may
        # still serve, colocated or in another pair (vLLM: the decode prefilling itself). A
        # prefill with no verdict is avoided by the retry all the same (it may be the one hung).
        worker = culprit(e, concurrent=False)
        return {pair} if worker is None else {pair, worker}
    return set(ran)


def leg_failure(
    e: UpstreamConnectError | UpstreamProtocolError, leg: str, phase: str, worker: str
) -> GatewayError:
    """What an upstream call's failure is to the request: the worker's failure (retried elsewhere,
    counted by its breaker), or, when the gateway itself could not open a connection (out of file
    descriptors or ports), a 503 to retry later, for which no worker is blamed (the leg that ends
    with it marks its attempt as having no verdict)."""
    if isinstance(e, LocalResourceError):
        return ShortOfResources(
            f"the gateway is short of resources to reach {leg}: {e}; retry later", retry_after_s=1.0
        )
    # a connect error never reached the engine; a broken connection reached one that may have
    # died of the request (gateway/orchestration/quarantine.py)
    dropped = isinstance(e, UpstreamProtocolError)
    return UpstreamFailure(f"{leg}: {e}", phase=phase, worker=worker, dropped=dropped)


def upstream_status_error(
    status: int, body: bytes, worker: str, phase: str, ctype: bytes = b"application/json"
) -> GatewayError:
    """An engine's answer other than 200: a 5xx, 408 or 429 is the worker's failure (retried
    elsewhere), anything else the request's (the engine's 4xx, passed on)."""
    if status >= 500 or status in (408, 429):
        # the engine's own words as text (a bytes repr would show b'...' and escapes to clients)
        said = body[:200].decode("utf-8", "replace").strip()
        return UpstreamFailure(
            f"worker {worker} answered HTTP {status}: {said}",
            phase=phase,
            worker=worker,
            answered=True,
            held=status >= 500 and status != 503,  # a 503 (overloaded) never took it on
        )
    return UpstreamRejected(status, body, ctype)


def prefill_error(prefill: str, v: PrefillVerdict) -> GatewayError:
    """A prefill's refusal as the request's error: retried elsewhere when another worker may not
    refuse it, else the engine's own answer (or a 400)."""
    if v.retryable:
        return PrefillFailed(f"prefill {prefill}: {v.reason}", phase="prefill", worker=prefill)
    if v.body and v.status < 500 and v.body.lstrip().startswith(b"{") and b'"error"' in v.body:
        return UpstreamRejected(v.status, v.body)
    return BadRequest(v.reason, status=v.status if 400 <= v.status < 500 else 400)


def prefill_refusal(prefill: str, decode: str, v: PrefillVerdict, *, decode_took: bool) -> GatewayError:
    """The error for a prefill answer that is no basis for a decode. `decode_took`: the prefill
    refused (4xx) what its decode did not refuse."""
    if v.handoff:
        # its KV did not reach the decode: no verdict on either worker (the pair breaker counts
        # it, and the retry avoids the pair), whichever leg's failure came first
        return PrefillFailed(
            f"prefill {prefill}: its KV transfer to decode {decode} failed: {v.reason}",
            phase="prefill",
            worker=None,
        )
    if decode_took and not v.retryable:
        # sglang #30233 (a prefill whose limit is below its decode's): not the request's fault,
        # so the next rung (another pair, a colocated worker) may serve it; no verdict on the
        # prefill (worker None: the pair is avoided), since a request can provoke this
        return PrefillFailed(
            f"prefill {prefill} refused what decode {decode} accepted: {v.reason}",
            phase="prefill",
            worker=None,
            instead=prefill_error(prefill, v),  # no other route: the engine's own answer
        )
    return prefill_error(prefill, v)
