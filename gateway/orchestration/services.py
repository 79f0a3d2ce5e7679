"""What every part of the request path uses: the registry, the policy, the metrics, the configuration,
the RNG, and the background tasks the path leaves running (engine abort calls, shadow runs)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from typing import Any

from common.request import ParsedRequest
from common.workers import RouteKind
from gateway.config import GatewayConfig
from gateway.guards import Guard
from gateway.http.client import UpstreamResponse
from gateway.http.errors import UpstreamConnectError, UpstreamProtocolError
from gateway.logging import get_logger
from gateway.metrics import GatewayMetrics
from gateway.orchestration.sampling import ShareSampler
from gateway.registry import Registry, Worker
from gateway.routing_tokenizer import HfTokenizer, RoutingTokenizer, Tokenizing
from policies.base import Needs, Policy, RerunHost, needs_of

log = get_logger("pd_gateway.request")

Header = tuple[bytes, bytes]
_ABORT_HEADERS = [(b"content-type", b"application/json")]
ABORT_S = 2.0  # an abort call to an engine
ABORT_REPEAT_S = 0.5  # the abort call is sent again after this long


def engine_headers(w: Worker, headers: list[Header]) -> list[Header]:
    """The engine-bound headers, with the worker's own API key when it has one."""
    if w.authorization is None:
        return headers
    return [*(h for h in headers if h[0] != b"authorization"), (b"authorization", w.authorization)]


class Services:
    __slots__ = (
        "background",
        "cfg",
        "metrics",
        "needs",
        "policy",
        "registry",
        "reruns",
        "rng",
        "sample_after_delivery",
        "sample_before_delivery",
        "tokenizing",
        "verify_share",
    )

    def __init__(
        self,
        registry: Registry,
        policy: Policy,
        metrics: GatewayMetrics,
        cfg: GatewayConfig,
        rng: random.Random,
    ) -> None:
        self.registry = registry
        self.policy = policy
        self.metrics = metrics
        self.cfg = cfg
        self.rng = rng
        # the share of greedy P/D answers verified by a colocated re-run (`guards.shadow_fraction`),
        # drawn from its own generator with a fixed seed (`guards.shadow_seed`, 0: the first pick
        # at the 37th eligible answer): which answers are picked is the same from run to run, so
        # a run that counts engine requests sees the same re-runs every time, not one in three
        # by chance
        self.verify_share = ShareSampler(cfg.guards.shadow_fraction, random.Random(cfg.guards.shadow_seed))
        g = cfg.guards
        self.sample_before_delivery = g.shadow_before_delivery and g.shadow_fraction > 0
        self.sample_after_delivery = not g.shadow_before_delivery and g.shadow_fraction > 0
        # what the policy reads beyond the usual (a prompt key; the cached tokens an answer reports)
        self.needs: Needs = needs_of(policy)
        # where the policy places and books verification re-runs itself (shadow.py)
        self.reruns: RerunHost | None = policy if isinstance(policy, RerunHost) else None
        self.background: set[asyncio.Task[None]] = set()
        # the routing tokenizer, where the policy keys prompts and KV events are configured
        # (gateway/routing_tokenizer.py; the gateway sets it): None, no text prompt is tokenized
        self.tokenizing: Tokenizing | None = None

    def tokenizer(self) -> RoutingTokenizer | None:
        """The routing tokenizer for a request now (None: keys stay untokenized)."""
        t = self.tokenizing
        return None if t is None else t.get()

    def offloaded(self, req: ParsedRequest) -> HfTokenizer | None:
        """The tokenizer that encodes the request's text prompt in a worker thread, as it is
        served (`Tokenizing.offloads`); None: tokenized inline, or not at all."""
        t = self.tokenizing
        if (
            t is None
            or not t.offload_bytes
            or req.prompt_is_ids
            or req.is_batch
            or req.route is RouteKind.CHAT
        ):
            return None
        return t.offloads(req.prompt_units)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` beside the request, kept until it ends (`drain`)."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def drain(self, within_s: float) -> None:
        if self.background:
            await asyncio.wait(list(self.background), timeout=within_s)

    def guard_failed(self, guard: Guard, stage: str, request_id: str, why: str, **kw: object) -> None:
        self.metrics.child(self.metrics.guard_failures, guard.value, stage).inc()
        log.warning("guard.failed", guard=guard.value, stage=stage, request_id=request_id, reason=why, **kw)

    def head_budget(self, req: ParsedRequest, w: Worker, first_byte_s: float) -> float:
        """How long to wait for a worker's response headers. A stream's come with its first
        token: `first_byte_s`. A non-streamed answer's come with its last token, so it also gets
        `per_token_s` for each token it may generate (its max_tokens, else the worker's context
        length); the request's total deadline bounds both."""
        if req.stream:
            return first_byte_s
        limit = req.max_tokens
        if limit is None:
            limit = w.info.context_length or req.accounting_max_tokens
        return first_byte_s + self.cfg.timeouts.per_token_s * limit

    def abort_leg(
        self, w: Worker, resp: UpstreamResponse | None, req: ParsedRequest, request_id: str
    ) -> None:
        """Stop an engine working on a request nobody will read: close the connection, and send
        the engine's abort call where it has one."""
        if resp is not None:
            resp.abort()
        call = w.adapter.abort_call(req, request_id)
        if call is None:
            return
        self.spawn(self._send_abort(w, *call))

    async def _send_abort(self, w: Worker, path: str, body: bytes) -> None:
        """Send the engine's abort call, and once more a moment later: an abort that overtakes
        the request it names (still in the engine's socket buffer) finds nothing to abort, and
        the request would then wait for KV that never comes (300 s on SGLang)."""
        for delay in (0.0, ABORT_REPEAT_S):
            if delay:
                await asyncio.sleep(delay)
            self.metrics.child(self.metrics.aborts_sent, w.engine.value).inc()
            try:
                async with asyncio.timeout(ABORT_S):
                    resp = await w.pool.request("POST", path, engine_headers(w, _ABORT_HEADERS), body)
                    await resp.read()
                    resp.release()
            except (TimeoutError, UpstreamConnectError, UpstreamProtocolError) as e:
                log.warning("abort.failed", worker=w.id, error=str(e))
                return
