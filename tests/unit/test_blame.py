"""Who failed, rule by rule (gateway/orchestration/blame.py): each rule's cases as a table, so a
change to one is seen here and not only through the whole request path."""

from __future__ import annotations

import asyncio

import pytest

from adapters import PrefillVerdict
from common.errors import (
    BadRequest,
    GatewayError,
    KVIntegrityError,
    NoWorker,
    PrefillFailed,
    ShortOfResources,
    UpstreamFailure,
    UpstreamRejected,
    UpstreamTimeout,
)
from common.outcomes import LegOutcome
from gateway.http.errors import LocalResourceError, UpstreamConnectError, UpstreamProtocolError
from gateway.orchestration.blame import (
    DecodeUnreached,
    Fault,
    LegShape,
    exclusions,
    fault_of,
    held_against,
    is_client_fault,
    leg_failure,
    leg_outcome,
    pair_outcome,
    prefill_refusal,
)

REFUSAL = UpstreamRejected(400, b'{"error":{"message":"too long"}}')
DIED = UpstreamFailure("decode d: connection reset", phase="decode", worker="d")
PREFILL_500 = UpstreamFailure("worker p answered HTTP 500", phase="prefill", worker="p", answered=True)
DECODE_500 = UpstreamFailure("worker d answered HTTP 500", phase="decode", worker="d", answered=True)
PREFILL_SLOW = UpstreamTimeout("prefill p gave no verdict", phase="prefill", worker="p")
HEADERS_SLOW = UpstreamTimeout("decode d sent no headers", phase="handoff", worker="d")
KV_BAD = KVIntegrityError("KV integrity check failed", phase="decode", worker="d")
TRANSFER = PrefillFailed("prefill p: its KV transfer to decode d failed", phase="prefill", worker=None)
PROVOKED = PrefillFailed(
    "prefill p refused what decode d accepted", phase="prefill", worker=None, instead=REFUSAL
)
UNREACHED = DecodeUnreached("decode d: connection refused", phase="decode", worker="d")
SHORT = ShortOfResources("the gateway is short of resources", retry_after_s=1.0)
LEFT = asyncio.CancelledError()  # the client went away, or the request's own deadline


@pytest.mark.parametrize(
    ("error", "concurrent", "fault", "worker"),
    [
        (None, True, Fault.NONE, None),
        (LEFT, True, Fault.NONE, None),
        (REFUSAL, True, Fault.NONE, None),
        (SHORT, False, Fault.NONE, None),
        (DIED, True, Fault.WORKER, "d"),
        (PREFILL_500, True, Fault.WORKER, "p"),  # an answered prefill failure is its own
        (
            DECODE_500,
            True,
            Fault.HANDOFF,
            None,
        ),  # a decode answering a failure: a transfer that failed looks so
        (DECODE_500, False, Fault.HANDOFF, None),
        (PREFILL_SLOW, True, Fault.HANDOFF, None),  # SGLang: it may wait for a decode that took no KV
        (PREFILL_SLOW, False, Fault.WORKER, "p"),  # vLLM: its prefill runs alone
        (HEADERS_SLOW, True, Fault.WORKER, "d"),
        (KV_BAD, True, Fault.HANDOFF, None),
        (KV_BAD, False, Fault.HANDOFF, None),
        (TRANSFER, True, Fault.HANDOFF, None),
        (PROVOKED, True, Fault.PROVOKED, None),
        (UNREACHED, False, Fault.WORKER, "d"),
    ],
)
def test_fault_of_a_failed_handoff(
    error: BaseException | None, concurrent: bool, fault: Fault, worker: str | None
) -> None:
    assert fault_of(error, concurrent=concurrent) == (fault, worker)


@pytest.mark.parametrize(
    ("error", "client"),
    [
        (None, False),
        (LEFT, False),
        (REFUSAL, True),
        (BadRequest("max_tokens must be at least 1"), True),
        (SHORT, False),  # the gateway's own shortage is no one's fault
        (NoWorker("no worker"), True),  # (a non-retryable answer of the gateway's own)
        (DIED, False),
        (PROVOKED, False),  # retryable: the next rung may serve it
    ],
)
def test_what_is_the_request_s_own_fault(error: BaseException | None, client: bool) -> None:
    assert is_client_fault(error) is client


@pytest.mark.parametrize(
    ("worker", "error", "shape", "held"),
    [
        ("w", LEFT, LegShape.ALONE, True),  # a request's own deadline is still a verdict
        ("w", DIED, LegShape.ALONE, True),
        ("p", PREFILL_SLOW, LegShape.ALONE, True),  # vLLM's prefill
        ("p", PREFILL_SLOW, LegShape.CONCURRENT, False),
        ("d", PREFILL_SLOW, LegShape.CONCURRENT, False),
        ("d", DIED, LegShape.CONCURRENT, True),
        ("p", DIED, LegShape.CONCURRENT, False),  # cut short by its decode's failure
        ("d", DECODE_500, LegShape.SEQUENTIAL, False),  # the pair's
        ("d", UNREACHED, LegShape.SEQUENTIAL, True),
        ("d", LEFT, LegShape.SEQUENTIAL, False),
    ],
)
def test_which_failures_a_leg_answers_for(
    worker: str, error: BaseException, shape: LegShape, held: bool
) -> None:
    assert held_against(worker, error, shape) is held


@pytest.mark.parametrize(
    ("done", "error", "blamed", "unjudged", "outcome"),
    [
        (True, None, False, False, LegOutcome.DONE),
        (True, DIED, True, True, LegOutcome.DONE),  # a prefill that did its part, whatever followed
        (False, REFUSAL, True, False, LegOutcome.REFUSED),
        (False, REFUSAL, False, True, LegOutcome.REFUSED),  # a refusal is a verdict even then
        (False, DIED, True, False, LegOutcome.FAILED),
        (False, DIED, False, False, LegOutcome.SPARED),
        (False, DIED, True, True, LegOutcome.NO_VERDICT),  # the client left, or a sibling unit failed
        (False, LEFT, True, False, LegOutcome.FAILED),  # the request's deadline on a leg alone
        (False, LEFT, True, True, LegOutcome.NO_VERDICT),  # the client went away
        (False, SHORT, True, True, LegOutcome.NO_VERDICT),
    ],
)
def test_what_a_leg_s_end_says_of_its_worker(
    done: bool, error: BaseException | None, blamed: bool, unjudged: bool, outcome: LegOutcome
) -> None:
    assert leg_outcome(done=done, error=error, blamed=blamed, unjudged=unjudged) is outcome


@pytest.mark.parametrize(
    ("outcome", "verdict"),
    [
        (LegOutcome.DONE, True),
        (LegOutcome.REFUSED, True),
        (LegOutcome.FAILED, False),
        (LegOutcome.SPARED, None),
        (LegOutcome.NO_VERDICT, None),
    ],
)
def test_the_breaker_verdict_of_each_outcome(outcome: LegOutcome, verdict: bool | None) -> None:
    assert outcome.verdict is verdict


@pytest.mark.parametrize(
    ("decode_done", "error", "unjudged", "concurrent", "outcome", "between"),
    [
        (True, None, False, True, LegOutcome.DONE, False),
        (False, PROVOKED, False, True, LegOutcome.NO_VERDICT, False),  # clients would open it
        (False, KV_BAD, False, True, LegOutcome.FAILED, True),
        (False, TRANSFER, False, True, LegOutcome.FAILED, True),
        (False, DECODE_500, False, False, LegOutcome.FAILED, True),
        (False, DIED, False, True, LegOutcome.FAILED, False),  # one worker's: no suspects
        (False, PREFILL_SLOW, False, True, LegOutcome.FAILED, True),
        (False, PREFILL_SLOW, False, False, LegOutcome.FAILED, False),
        (False, REFUSAL, False, True, LegOutcome.REFUSED, False),
        (False, KV_BAD, True, True, LegOutcome.NO_VERDICT, True),
        (False, LEFT, False, True, LegOutcome.FAILED, False),  # the request's deadline
        (False, LEFT, True, True, LegOutcome.NO_VERDICT, False),
    ],
)
def test_the_pair_s_outcome(
    decode_done: bool,
    error: BaseException | None,
    unjudged: bool,
    concurrent: bool,
    outcome: LegOutcome,
    between: bool,
) -> None:
    got = pair_outcome(decode_done=decode_done, error=error, unjudged=unjudged, concurrent=concurrent)
    assert got == (outcome, between)


@pytest.mark.parametrize(
    ("ran", "error", "excluded"),
    [
        (("c",), DIED, {"c"}),
        (("c",), HEADERS_SLOW, {"c"}),
        (("p", "d"), DIED, {"p|d", "d"}),
        (("p", "d"), PREFILL_500, {"p|d", "p"}),
        (("p", "d"), PREFILL_SLOW, {"p|d", "p"}),  # avoided by the retry all the same
        (("p", "d"), KV_BAD, {"p|d"}),  # both may still serve elsewhere
        (("p", "d"), DECODE_500, {"p|d"}),
        (("p", "d"), TRANSFER, {"p|d"}),
    ],
)
def test_what_the_next_attempt_avoids(
    ran: tuple[str, ...], error: UpstreamFailure, excluded: set[str]
) -> None:
    assert exclusions(ran, error) == excluded


@pytest.mark.parametrize(
    ("cause", "kind", "worker"),
    [
        (UpstreamConnectError("refused"), UpstreamFailure, "w"),
        (UpstreamProtocolError("reset"), UpstreamFailure, "w"),
        (LocalResourceError("EMFILE"), ShortOfResources, None),
    ],
)
def test_an_upstream_call_s_failure(
    cause: UpstreamConnectError, kind: type[GatewayError], worker: str | None
) -> None:
    e = leg_failure(cause, "worker w", "colocated", "w")
    assert type(e) is kind
    assert getattr(e, "worker", None) == worker


@pytest.mark.parametrize(
    ("verdict", "decode_took", "kind", "worker", "instead"),
    [
        (PrefillVerdict(ok=False, reason="KVTransferError", handoff=True), False, PrefillFailed, None, None),
        (PrefillVerdict(ok=False, reason="HTTP 500", status=500), False, PrefillFailed, "p", None),
        (
            PrefillVerdict(ok=False, reason="too long", retryable=False, status=400, body=b'{"error":"x"}'),
            True,
            PrefillFailed,
            None,
            UpstreamRejected,
        ),
        (
            PrefillVerdict(ok=False, reason="too long", retryable=False, status=400, body=b'{"error":"x"}'),
            False,
            UpstreamRejected,
            None,
            None,
        ),
        (PrefillVerdict(ok=False, reason="bad", retryable=False, status=422), False, BadRequest, None, None),
    ],
)
def test_a_refused_prefill_s_error(
    verdict: PrefillVerdict,
    decode_took: bool,
    kind: type[GatewayError],
    worker: str | None,
    instead: type[GatewayError] | None,
) -> None:
    e = prefill_refusal("p", "d", verdict, decode_took=decode_took)
    assert type(e) is kind
    if isinstance(e, UpstreamFailure):
        assert e.worker == worker
        assert (type(e.instead) if e.instead is not None else None) is instead
    if isinstance(e, BadRequest):
        assert e.status == 422
