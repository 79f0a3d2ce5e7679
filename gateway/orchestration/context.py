"""One request's state on its way through the orchestrator, in one object.

`RequestContext` is made by `Orchestrator.context` when a request has been parsed, and carries
everything the request path needs about it: the parsed request and its routing view, the
client's responder, the handler task that its deadlines cancel, the engine-bound headers, the
plan's workers, the retry state (attempt number, exclusions, history) and the current `Attempt`.
A split request's units (gateway/orchestration/split.py) get contexts of their own (`unit`),
which share the request's deadlines and headers.

Places kept for what comes next: each `Attempt` collects a `LegRecord` per engine leg as it
ends (`Attempt.legs`), which `Completed` and `Failed` events hand to the policy's `observe`.
"""

from __future__ import annotations

import asyncio
import enum
import time

import msgspec

from common.errors import UpstreamFailure
from common.outcomes import LegRecord
from common.request import DEFAULT_MAX_TOKENS, ParsedRequest
from gateway.deadlines import Deadline, DeadlineWheel
from gateway.http.server import Responder
from gateway.orchestration.keying import prompt_key
from gateway.routing_tokenizer import HfTokenizer, RoutingTokenizer
from policies.snapshot import RequestView

Header = tuple[bytes, bytes]


class Phase(enum.StrEnum):
    """Where an attempt is. planned → prefill (SGLang: prefill ∥ decode) → handoff → streaming
    → done; a failure is recorded with the phase it happened in."""

    PLANNED = "planned"
    PREFILL = "prefill"
    HANDOFF = "handoff"
    STREAMING = "streaming"
    DONE = "done"


class Attempt(msgspec.Struct, eq=False):
    """One attempt's position in its state machine and what it learned, for logging, metrics
    and the policy's events. (A Struct: built in C, as each request makes one or more.)"""

    cut: bool = False  # a split unit cancelled because a sibling failed: no verdict on its workers
    phase: Phase = Phase.PLANNED
    plan_kind: str = "none"
    prefill: str | None = None
    decode: str | None = None
    started: float = msgspec.field(default_factory=time.monotonic)
    prefill_done_at: float = 0.0
    first_byte_at: float = 0.0
    first_token_at: float = 0.0  # a relayed stream's first token, as near as the relay knows it
    moved_from: list[str] | None = None  # vLLM decodes this attempt's decode leg left
    legs: list[LegRecord] = []  # each engine leg's outcome, in the order they ended
    # the prompt tokens the engine that prefilled found cached, as it reported them (None: not
    # reported, or not read: gateway/orchestration/feedback.py)
    cached: int | None = None
    decision: str = ""  # the plan's reason (the decider's verdict: "cost:pd:roomy", ...)
    chunks: int = 0  # a relayed stream's upstream reads
    output_tokens: int | None = None  # the answer's own count, where the relay read one


class RequestContext(msgspec.Struct, eq=False):
    """Everything one request's path needs, from planning to the access log line."""

    req: ParsedRequest
    request_id: str
    res: Responder  # the client's responder (a split unit's: its SampleSink)
    task: asyncio.Task[None]  # the request's handler task: what a deadline cancels
    view: RequestView
    wheel: DeadlineWheel
    headers: list[Header]  # engine-bound: content type, request id, forwarded authorization
    echo: Header  # the x-request-id header echoed to the client
    began: float = 0.0  # monotonic, when serving began (after admission)
    attempt: Attempt = msgspec.field(default_factory=Attempt)
    attempt_no: int = 0
    history: list[str] = []  # failed attempts: "plan:phase reached:error code"
    exclude: set[str] = set()  # worker and pair ids that failed for this request
    last_error: UpstreamFailure | None = None
    drops: int = 0  # attempts whose engine broke its connection holding the request (quarantine.py)
    # its token ids are above every id its model has been seen to serve: it holds its model's
    # turn for such requests until it ends (token_bounds.py)
    unproven: bool = False
    # the workers of the plan running now (a moved vLLM decode's new one), for whoever waits
    # on requests not started yet (the admin API removing a worker)
    planned: tuple[str, ...] = ()
    # the policy was told `Routed` for the attempt running now and not yet how it ended (every
    # `Routed` is followed by one `Completed` or `Failed`, whatever way the request ends)
    routed: bool = False
    outcome: str = "ok"
    total: Deadline | None = None  # the request's total deadline, while it is served
    # its own size explains a run past the total deadline (sizing.py): then no verdict on its workers
    client_sized: bool = False
    error: str | None = None  # the failure's detail, for the access log line (never the client's)
    # the client asked why its worker was chosen (`explain_header`); the answer's extra headers
    explain: bool = False
    extra: tuple[Header, ...] = ()
    # its text prompt is tokenized in a worker thread as it is served, not yet (keying.py `later`)
    tokenize: HfTokenizer | None = None
    # seconds the policy holds the attempt before it is sent (policies/inflight.py; 0: none)
    hold_s: float = 0.0

    @property
    def tokens(self) -> int:
        """Prompt and output tokens the request brings, in the workers' load accounting."""
        return self.view.prompt_tokens + self.view.max_tokens

    @property
    def responded(self) -> bool:
        """The response to the client has started: its workers are fixed."""
        return self.res.started

    @property
    def closed(self) -> bool:
        """The client's connection is gone."""
        return self.res.closed

    @property
    def unjudged(self) -> bool:
        """Does the attempt end without a verdict on its workers (the client left, or the attempt
        was cut: a sibling unit failed, the gateway ran short of resources; or the total deadline
        fired on a request whose own size explains it: sizing.py)?"""
        if self.res.closed or self.attempt.cut:
            return True
        total = self.total
        return total is not None and total.expired and self.client_sized

    def unit(
        self, req: ParsedRequest, request_id: str, res: Responder, task: asyncio.Task[None], view: RequestView
    ) -> RequestContext:
        """A split request's unit as a request of its own: its own request, name, sink, task and
        attempt, the parent's deadlines, headers and echoed id."""
        u = RequestContext(req, request_id, res, task, view, self.wheel, self.headers, self.echo)
        u.total, u.client_sized = self.total, self.client_sized  # whose the total deadline is
        a, parent = u.attempt, self.attempt
        a.plan_kind, a.prefill, a.decode = parent.plan_kind, parent.prefill, parent.decode  # metric labels
        return u


def request_view(
    req: ParsedRequest,
    request_id: str,
    chars_per_token: float,
    keyed: bool = False,
    session: bytes | None = None,
    tokenizer: RoutingTokenizer | None = None,
) -> RequestView:
    """What routing needs of a request (policies read only this). `keyed`: with its prompt's key
    (`prompt_key`; where the policy matches prefixes, `Needs.prompt_key`). `session`: its session
    header's value, which comes before the body's `session_id` and `user`. `tokenizer`: the
    routing tokenizer, where a text prompt's ids are wanted (keying.py); a prompt it tokenized
    counts its ids, not the `chars_per_token` estimate."""
    key = prompt_key(req, tokenizer) if keyed else None
    if key is not None and key.token_ids is not None:
        units = len(key.token_ids)
    else:
        units = req.prompt_units if req.prompt_is_ids else int(req.prompt_units / chars_per_token) + 1
    # (`accounting_max_tokens` and, for a string or no `session_id`, `_session_key`, inline)
    budget = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS[req.route]
    sid = req.fields.session_id
    return RequestView(
        request_id=request_id,
        model=req.model,
        route=req.route,
        prompt_tokens=units,
        max_tokens=budget * req.n * req.batch,
        stream=req.stream,
        n=req.n,
        greedy=req.greedy,
        session_key=(session.decode("latin-1") if session else None)
        or (sid if sid is None or sid.__class__ is str else _session_key(sid))
        or req.fields.user,
        prompt_key=key,
    )


def _session_key(sid: object) -> str | None:
    """A client's `session_id` as a routing key: a string or an integer; anything else (not an
    engine field, so no engine refuses it) is ignored."""
    if sid is None or isinstance(sid, str):
        return sid
    if isinstance(sid, int) and not isinstance(sid, bool):
        return str(sid)
    return None
