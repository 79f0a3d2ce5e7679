"""Active health checks and metric scrapes: background tasks that update the registry.

A worker becomes healthy after `success_threshold` good probes in a row and unhealthy after
`failure_threshold` bad ones. A probe is the adapter's health endpoint, each request of it bounded
by `timeout_s`; when it answers, the worker's info endpoints (model, context length, SGLang's input
limit and bootstrap port) are read if the worker is not healthy yet or failed a probe since its
last good one (it may have restarted with another model or context length: what it says now
replaces what it said before it became usable again), and otherwise every `info_every` probes.
Between those reads every good probe also reads the model listing (`/v1/models`, one small GET
both engines serve): a server restarted on the same address between two probes fails none of
them, so a listing that names another model or context length than at the last read is taken as
such a restart and the info endpoints are read afresh at once.
Metrics are scraped on their own interval and parsed by the adapter into a `WorkerLoad`. Request
outcomes (passive detection) act through the breakers.

After each round of probes (and after the admin API adds or removes a worker) the worker set is
checked for models it can never serve, whatever their health (an SGLang decode without an SGLang
prefill of its model and no colocated worker): each such model is logged once, as a warning that
says what is missing (`unservable_models`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import msgspec

from adapters import ProbeInfo
from common.workers import Engine, Role
from gateway.config import HealthConfig
from gateway.http.errors import LocalResourceError, UpstreamError
from gateway.logging import get_logger
from gateway.registry import Registry, Worker

log = get_logger("pd_gateway.health")

# The model listing: cheap, and it names the model and (vLLM and SGLang) its context length.
_LISTING = "/v1/models"


async def _get(w: Worker, path: str, timeout_s: float) -> tuple[int, bytes]:
    """One probe GET, with the worker's API key when it has one (a hosted endpoint may ask for it
    on every path, its health and model listing included)."""
    headers = [(b"accept", b"*/*")]
    if w.authorization is not None:
        headers.append((b"authorization", w.authorization))
    async with asyncio.timeout(timeout_s):
        resp = await w.pool.request("GET", path, headers, None)
        try:
            body = await resp.read()
        except BaseException:
            resp.abort()
            raise
        resp.release()
        return resp.status, body


class HealthChecker:
    def __init__(
        self, registry: Registry, settings: HealthConfig | None = None, info_every: int = 12
    ) -> None:
        self.registry = registry
        self.settings = settings or HealthConfig()
        self.info_every = info_every  # a worker's info endpoints are read every this many probes
        self._rounds: dict[str, int] = {}
        # per worker: what its model listing said at the last info read (model, context length)
        self._listed: dict[str, ProbeInfo] = {}
        self._unservable: dict[str | None, str] = {}  # what was last warned about

    def forget(self, worker_id: str) -> None:
        """Drop what is kept about a removed worker."""
        self._rounds.pop(worker_id, None)
        self._listed.pop(worker_id, None)

    async def probe(self, w: Worker) -> bool:
        s = self.settings
        n = self._rounds.get(w.id, 0)
        self._rounds[w.id] = n + 1
        try:
            status, _ = await _get(w, w.adapter.health_path, s.timeout_s)
            ok = status == 200
            reason = f"HTTP {status}"
            if ok:
                ok, reason = await self._check_info(w, n)
        except LocalResourceError as e:
            # the gateway could not open a connection for want of its own descriptors: no
            # verdict on the worker this round (it must not be marked down for the gateway's
            # shortage, which its requests meet as a 503 that blames no worker either)
            log.warning("worker.probe_skipped", worker=w.id, error=str(e))
            return w.healthy
        except (TimeoutError, UpstreamError, OSError) as e:
            ok, reason = False, _why(e)
        was = w.healthy
        if ok:
            w.probe_failures = 0
            w.probe_successes += 1
            if w.probe_successes >= s.success_threshold:
                w.healthy = True
        else:
            w.probe_successes = 0
            w.probe_failures += 1
            if w.probe_failures >= s.failure_threshold or not was:
                w.healthy = False
        if was != w.healthy:
            log.info("worker.health", worker=w.id, healthy=w.healthy, reason=None if ok else reason)
            self.registry.changed()
        return ok

    async def _check_info(self, w: Worker, n: int) -> tuple[bool, str]:
        """After a good health answer (probe `n` of `w`): read what has to be read of the info
        endpoints. (ok, why not) as the probe's outcome; a transport failure of an info read is
        a failed probe, as a failed health answer is."""
        # Not healthy yet (never probed, or down until now), or a probe failed since the last
        # good one: the server may have restarted serving another model or context length,
        # so what it says now replaces what is known before it is usable again.
        fresh = not w.healthy or w.probe_failures > 0
        if fresh or w.info.model is None or n % self.info_every == 0:
            return await self._read_info(w, fresh=fresh), "info endpoints failed"
        try:
            listed = await self._listing(w)
        except LocalResourceError:
            raise
        except (TimeoutError, UpstreamError, OSError) as e:
            return False, f"{_LISTING}: {_why(e)}"
        if listed is None or listed == self._listed.get(w.id):
            return True, ""
        # It restarted between two probes (none failed) with another model or context length:
        # read it afresh now, before more requests go to it by what it said before.
        was = self._listed.get(w.id)
        log.info(
            "worker.listing_changed",
            worker=w.id,
            model=listed.model,
            context_length=listed.context_length,
            was_model=was.model if was is not None else None,
            was_context_length=was.context_length if was is not None else None,
        )
        return await self._read_info(w, fresh=True), "info endpoints failed"

    async def _listing(self, w: Worker) -> ProbeInfo | None:
        """What the model listing says now (model and context length only), or None when the
        adapter does not read one or it did not answer 200 with a listing (as in `_read_info`,
        such an answer is no failure). Transport failures raise."""
        if _LISTING not in w.adapter.info_paths:
            return None
        status, body = await _get(w, _LISTING, self.settings.timeout_s)
        if status != 200:
            return None
        try:
            return w.adapter.parse_info(_LISTING, body, ProbeInfo())
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def _read_info(self, w: Worker, *, fresh: bool = False) -> bool:
        """Read the info endpoints into `w.info`: folded into what is known, or with `fresh`,
        replacing it (nothing said before a restart is kept). True when the model is known."""
        answers: list[tuple[str, bytes]] = []
        whole = True  # every info endpoint answered and was understood
        for path in w.adapter.info_paths:
            try:
                status, body = await _get(w, path, self.settings.timeout_s)
            except LocalResourceError:
                raise  # (no verdict on the worker: probe() skips the round)
            except (TimeoutError, UpstreamError, OSError):
                return False
            if status != 200:
                # /server_info is SGLang-only; a missing optional endpoint is not a failure
                whole = False
                continue
            answers.append((path, body))
        anew, folded = ProbeInfo(), w.info
        for path, body in answers:
            try:
                anew = w.adapter.parse_info(path, body, anew)
                folded = w.adapter.parse_info(path, body, folded)
                if path == _LISTING:  # what the probes between two reads compare against
                    self._listed[w.id] = w.adapter.parse_info(path, body, ProbeInfo())
            except (msgspec.DecodeError, msgspec.ValidationError):
                whole = False
        # Afresh only from a whole answer that names a model: a part missing this time (an
        # endpoint failing once) must not wipe what is known (context length, bootstrap port...).
        info = anew if fresh and whole and anew.model is not None else folded
        if info.model is None:
            info = w.info  # it did not say which model it serves now: keep what was known
        if info != w.info:
            w.info = info
            self.registry.changed()
        # A worker that refused the near-tie logprobs is asked again after each full read (it may
        # have restarted with a higher --max-logprobs): one refusal costs one prefill sent twice.
        w.near_ties = True
        return w.model is not None

    async def scrape(self, w: Worker) -> None:
        """Read the engine's own load report. The path that answered last is asked first; one
        that is not there (404) passes to the next, so an older engine falls back by itself."""
        paths = w.adapter.load_paths
        if w.load_path in paths:
            paths = (w.load_path, *(p for p in paths if p != w.load_path))
        for path in paths:
            try:
                status, body = await _get(w, path, self.settings.timeout_s)
            except (TimeoutError, UpstreamError, OSError):
                return
            if status != 200:
                continue
            w.load_path = path
            load = w.adapter.parse_load(path, body)
            if load is not None:
                w.load = msgspec.structs.replace(load, scraped_at=time.monotonic())
                self.registry.changed()
            return

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in list(self.registry.workers())))
        self.check_models()

    def check_models(self) -> None:
        """Warn once about each model the workers can never serve (see `unservable_models`),
        and note when one becomes servable. Cheap: a pass over the workers per model."""
        now = unservable_models(self.registry.workers())
        for model, missing in now.items():
            if self._unservable.get(model) != missing:
                log.warning(
                    "cluster.model_unservable",
                    model=model if model is not None else "(not known yet)",
                    missing=missing,
                    detail=f"every request for {_model_text(model)} is a 503 until there is one",
                )
        for model in self._unservable.keys() - now.keys():
            if model is not None:
                log.info("cluster.model_servable", model=model)
        self._unservable = now

    async def run_probes(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.probe_all()
            for w in list(self.registry.workers()):
                w.pool.prune()  # idle upstream connections past their reuse window

    async def run_scrapes(self) -> None:
        while True:
            await asyncio.gather(*(self.scrape(w) for w in list(self.registry.workers()) if w.healthy))
            await asyncio.sleep(self.settings.scrape_interval_s)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _model_text(model: str | None) -> str:
    return f"model {model!r}" if model is not None else "any model"


def unservable_models(workers: Iterable[Worker]) -> dict[str | None, str]:
    """The models these workers can never serve, healthy or not, each with what is missing.

    Planning (policies/pd.py) serves a model on a colocated worker, a P/D pair (a prefill and a
    decode of the same engine) or a vLLM decode prefilling itself; an SGLang decode cannot answer
    alone and a prefill never does. A worker whose model is not known yet (never probed) may
    serve any model, as in planning. When no worker's model is known, the set is checked as a
    whole: the key is then None ("any model")."""
    ws = list(workers)
    models = {w.model for w in ws if w.model is not None}
    groups: dict[str | None, list[Worker]] = {m: [w for w in ws if w.model in (m, None)] for m in models}
    if not models and ws:
        groups[None] = ws
    out: dict[str | None, str] = {}
    for model, group in groups.items():
        missing = _missing(group)
        if missing is not None:
            out[model] = missing
    return out


def _missing(group: list[Worker]) -> str | None:
    """What `group` (the workers that may serve one model) lacks to serve it; None if nothing."""
    decodes: dict[Engine, list[str]] = {}
    prefills: dict[Engine, list[str]] = {}
    for w in group:
        if w.role is Role.COLOCATED or (w.role is Role.DECODE and w.adapter.decode_alone):
            return None  # serves alone
        pool = decodes if w.role is Role.DECODE else prefills
        pool.setdefault(w.engine, []).append(w.id)
    if decodes.keys() & prefills.keys():
        return None  # a P/D pair
    needs = [
        f"a {e.value} prefill worker for the decode worker(s) {sorted(ids)}" for e, ids in decodes.items()
    ]
    needs += [
        f"a {e.value} decode worker for the prefill worker(s) {sorted(ids)}" for e, ids in prefills.items()
    ]
    return ", or ".join([*needs, "a colocated worker"])
