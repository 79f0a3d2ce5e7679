"""Token-id bounds learned per model where no vocabulary size is known (issue #27, queries of death).

SGLang 0.5.23 does not check a prompt's token ids: one outside the vocabulary makes its scheduler's
embedding lookup raise, and the server exits (so do stop ids with a minimum length: they are
scattered into a vocabulary-wide tensor). With `vocab_size` configured the gateway refuses such
ids itself (checks.py). The engines do not say their vocabulary size: SGLang 0.5.23's
/model_info gives the model's path, type and architectures, /server_info its server arguments and
scheduler limits, vLLM 0.32's /v1/models the context length; none the vocabulary. So with the
default configuration (no `vocab_size`), for each model with a worker that neither checks ids
itself (vLLM does: `checks_token_ids`) nor has a `vocab_size`, the gateway learns:

- `low`: the largest token id a served request proved inside the vocabulary (`index_id`, the
  largest id an engine read as an index: an engine that computed it has it; ids are valid
  exactly below the vocabulary size, so every id up to it is). A request whose ids are all at
  most `low` is *proven*, and passes for one comparison (`proven`); so does any request without
  token ids.
- An *unproven* request (an id above `low`):
  - waits its turn: one unproven request per model is in flight at a time; the others wait for
    its outcome (within their total deadline), then look again (`turn`);
  - is sent to one engine: a colocated worker where the model has one up (an SGLang P/D attempt
    sends the prompt to both legs, and both die of it);
  - served: `low` rises to its ids (`done`);
  - its engine died holding it (quarantine.py's probe found it gone): it is not tried again,
    its client gets a 400 `unproven_token_ids` naming the id (`killed`), and the death is
    remembered for `retries.quarantine_s`. While it is, unproven requests for the model are
    refused at once with a 400 (`retries.unproven_after_death`): all of them (`"refuse"`, the
    default), or only those with an id at or above the one that killed (`"probe"`: ids between
    `low` and it are still tried one at a time, each of which may cost one more engine).

What this guarantees, with `"refuse"`: after an engine death, no other unproven id reaches an
engine for `quarantine_s`, so out-of-vocabulary requests take down at most one colocated engine
(or one P/D pair, where the model has no colocated worker) per `quarantine_s`, whatever their
ids. Its price: a valid id above every id served so far is refused too during that time (a
400 that says why and names `vocab_size`). Configuring `vocab_size` avoids both.
"""

from __future__ import annotations

import asyncio
import time

from common.errors import ErrorCode, GatewayError, UpstreamFailure
from common.workers import Role
from gateway.logging import get_logger
from gateway.metrics import GatewayMetrics
from gateway.orchestration.context import RequestContext
from gateway.registry import Registry

log = get_logger("pd_gateway.request")

HINT = "set vocab_size on the model's workers so that the gateway checks token ids itself"


class UnprovenTokenIds(GatewayError):
    """A request whose token id is above every id its model has been seen to serve, and that
    an engine died of (or that is refused after such a death)."""

    status = 400
    code = ErrorCode.UNPROVEN_TOKEN_IDS
    type = "invalid_request_error"


class _Model:
    """One model's learned bounds."""

    __slots__ = ("killer", "logged", "low", "turn", "until")

    def __init__(self) -> None:
        self.low = -1  # every id up to it proven inside the vocabulary
        self.turn: asyncio.Future[None] | None = None  # the unproven request in flight ends it
        self.killer = -1  # the id of the unproven request whose engine died (-1: none)
        self.until = 0.0  # monotonic: when that death is forgotten
        self.logged = False  # its first refusal was logged


class TokenBounds:
    """The learned token-id bounds of every model whose workers do not check ids (module
    docstring); one per Orchestrator."""

    __slots__ = (
        "_guarded",
        "_models",
        "_version",
        "metrics",
        "probe_after_death",
        "registry",
        "seconds",
    )

    def __init__(
        self, registry: Registry, metrics: GatewayMetrics, seconds: float, probe_after_death: bool
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.seconds = seconds
        self.probe_after_death = probe_after_death
        self._models: dict[str, _Model] = {}
        self._guarded: dict[str, bool] = {}  # model -> no worker of it needs the bounds
        self._version = -1  # the registry's version `_guarded` was found at

    def proven(self, ctx: RequestContext) -> bool:
        """Are the request's token ids all at most its model's `low`? (Asked of requests with
        token ids only: `index_id >= 0`.)"""
        req = ctx.req
        m = self._models.get(req.model)
        return m is not None and req.index_id <= m.low

    def low(self, model: str) -> int:
        """Every id up to it is proven for `model` (-1: none yet)."""
        m = self._models.get(model)
        return -1 if m is None else m.low

    async def turn(self, ctx: RequestContext) -> None:
        """An unproven request: returns when it may be sent (`ctx.unproven` set: its outcome
        is `done`'s to record), or at once where its model's workers all check ids; raises
        `UnprovenTokenIds` where a recent death refuses it."""
        req = ctx.req
        if self._is_guarded(req.model):
            return
        m = self._models.get(req.model)
        if m is None:
            m = self._models[req.model] = _Model()
        while req.index_id > m.low:
            self._refuse(ctx, m)
            if m.turn is None:
                m.turn = asyncio.get_running_loop().create_future()
                ctx.unproven = True
                self._one_engine(ctx)
                return
            self.metrics.child(self.metrics.query_of_death, "unproven_waited").inc()
            await asyncio.wait((m.turn,))  # (its own cancellation leaves the turn alone)

    def done(self, ctx: RequestContext, served: bool) -> None:
        """The unproven request's outcome: served, its ids are proven; either way the next
        unproven request of its model may go."""
        ctx.unproven = False
        req = ctx.req
        m = self._models.get(req.model)
        if m is None:
            return
        if served and req.index_id > m.low:
            m.low = req.index_id
        turn, m.turn = m.turn, None
        if turn is not None and not turn.done():
            turn.set_result(None)

    def killed(self, ctx: RequestContext, e: UpstreamFailure, died: list[str]) -> None:
        """The engines of an unproven request died holding it: not tried again, its client
        told why (`e.instead`), the death remembered for `seconds`."""
        req = ctx.req
        m = self._models.get(req.model)
        if m is None:
            return
        ctx.drops = max(ctx.drops, 2)  # no other try
        now = time.monotonic()
        if self.seconds > 0:
            m.killer = req.index_id if m.until <= now else min(m.killer, req.index_id)
            m.until = now + self.seconds
            m.logged = False
        self.metrics.child(self.metrics.query_of_death, "unproven_killed").inc()
        log.warning(
            "request.unproven_token_ids_killed",
            request_id=ctx.request_id,
            model=req.model[:200],
            token_id=req.index_id,
            proven_up_to=m.low,
            workers=died,
            refused_s=self.seconds,
        )
        after = (
            f"; for {self.seconds:.0f}s, requests for this model with token ids above "
            f"{m.low if not self.probe_after_death else req.index_id - 1} are refused"
            if self.seconds > 0
            else ""
        )
        e.instead = UnprovenTokenIds(
            f"The engine serving this request died while holding it. Its token id {req.index_id} "
            f"is above every id this model has been seen to serve ({_upto(m.low)}), so it is "
            "most likely outside the model's vocabulary (SGLang does not check token ids and "
            f"dies of one outside). It is not tried on another engine{after}. The gateway does "
            f"not know the vocabulary size: {HINT}.",
            param=req.id_param,
        )

    def reset(self, model: str | None = None) -> int:
        """Forget recent deaths (of `model`, or of every model): unproven requests may be tried
        again. Returns how many models had one."""
        now = time.monotonic()
        n = 0
        for name, m in self._models.items():
            if (model is None or name == model) and m.until > now:
                m.until, m.killer = 0.0, -1
                n += 1
        return n

    def state(self) -> list[dict[str, object]]:
        """Each model's bounds, for the admin API."""
        now = time.monotonic()
        return [
            {
                "model": name,
                "proven_up_to": m.low,
                "unproven_in_flight": m.turn is not None,
                "killed_by": m.killer if m.until > now else None,
                "refusing_s": round(m.until - now, 1) if m.until > now else 0.0,
            }
            for name, m in self._models.items()
        ]

    def _refuse(self, ctx: RequestContext, m: _Model) -> None:
        """Raise `UnprovenTokenIds` where a recent death refuses this unproven request."""
        left = m.until - time.monotonic()
        if left <= 0:
            return
        req = ctx.req
        if self.probe_after_death and req.index_id < m.killer:
            return
        self.metrics.child(self.metrics.query_of_death, "unproven_refused").inc()
        if not m.logged:  # once per death
            m.logged = True
            log.warning(
                "request.unproven_token_ids_refused",
                request_id=ctx.request_id,
                model=req.model[:200],
                token_id=req.index_id,
                proven_up_to=m.low,
                killer=m.killer,
                left_s=round(left, 1),
            )
        if req.index_id >= m.killer:
            why = f"at or above {m.killer}, the id of a request whose engine died holding it"
        else:
            why = (
                f"above every id this model has been seen to serve ({_upto(m.low)}), and a request "
                "with such an id took down an engine"
            )
        raise UnprovenTokenIds(
            f"Token id {req.index_id} is {why} {self.seconds - left:.0f}s ago: it is most likely "
            f"outside the model's vocabulary, and such requests are refused for another {left:.0f}s "
            f"rather than risk another engine. The gateway does not know the vocabulary size: {HINT}.",
            param=req.id_param,
        )

    def _is_guarded(self, model: str) -> bool:
        """Does no worker of `model` need the bounds (each checks ids or has a `vocab_size`)?"""
        version = self.registry.version
        if version != self._version:
            self._guarded.clear()
            self._version = version
        guarded = self._guarded.get(model)
        if guarded is None:
            guarded = self._guarded[model] = all(
                w.adapter.checks_token_ids or w.vocab_size is not None
                for w in self.registry.workers()
                if w.model == model
            )
        return guarded

    def _one_engine(self, ctx: RequestContext) -> None:
        """Keep an unproven request off P/D pairs (both legs would die of it) where its model
        has a colocated worker up."""
        model = ctx.req.model
        mine = [w for w in self.registry.workers() if w.model == model]
        if any(w.role is Role.COLOCATED and w.healthy and w.breaker.admits and not w.draining for w in mine):
            ctx.exclude.update(w.id for w in mine if w.role is not Role.COLOCATED)


def _upto(low: int) -> str:
    return "none yet" if low < 0 else f"ids up to {low}"
