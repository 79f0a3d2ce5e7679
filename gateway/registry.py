"""The workers the gateway knows, their live state, and the frozen snapshots policies read.

Background tasks (health probes, metric scrapes, the admin API) and the request path (in-flight
accounting, breaker outcomes) update `Worker` objects; `snapshot()` rebuilds the frozen
`ClusterSnapshot` only when something changed since the last one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

import msgspec

from common.workers import Role, RouteKind
from gateway.breaker import BreakerState, CircuitBreaker
from gateway.config import BreakerConfig
from gateway.worker import Worker, new_breaker
from policies.snapshot import ClusterSnapshot, Layout, WorkerState, same_layout

_replace = msgspec.structs.replace

_CLOSED = BreakerState.CLOSED
# Enum members as module constants on the request path: on Python 3.11 a class attribute of an
# Enum goes through EnumType.__getattr__'s slot hook, unspecialised (~70 ns a look-up here),
# a global does not (~7 ns); ~35 such look-ups per request (docs/benchmarks.md)
_OPEN = BreakerState.OPEN
_HALF_OPEN = BreakerState.HALF_OPEN
_NO_PAIRS: frozenset[str] = frozenset()


class MembershipWatcher(Protocol):
    """Told when a worker joins or leaves the registry (from the configuration, the admin API or
    discovery), right after the change."""

    def worker_added(self, worker: Worker) -> None: ...

    def worker_removed(self, worker: Worker) -> None: ...


# a suspicion's window doubles each time its pair fails again soon after its end, up to this
# many times `guards.suspect_window_s` (`Registry.mark_suspect`)
SUSPECT_ESCALATION = 32


class Registry:
    def __init__(self, breaker: BreakerConfig | None = None, inflight_cap: int = 0) -> None:
        self.inflight_cap = inflight_cap  # requests in flight per worker before it is skipped; 0 = no cap
        self._full: set[str] = set()
        self._workers: dict[str, Worker] = {}
        self._pair_breakers: dict[str, CircuitBreaker] = {}
        self._suspect_until: dict[str, float] = {}  # pair id -> monotonic time its suspicion ends
        # pair id -> (its last suspicion's window, when that ended or ends): kept after the end,
        # so that a pair failing again soon after is suspected for twice as long (`mark_suspect`)
        self._suspicion: dict[str, tuple[float, float]] = {}
        # bumped whenever a pair is marked suspect: an answer on its way since before tells it
        # may have to be verified (one comparison per answer while nothing changes)
        self.suspect_epoch = 0
        self._breaker = breaker or BreakerConfig()
        self._version = 0  # bumped by anything but in-flight counts (membership, health, breakers, load)
        self._models: tuple[str, ...] | None = None  # cached until membership or info changes
        # per route: the workers whose engine does not answer it (cached like _models)
        self._not_serving: dict[RouteKind, frozenset[str]] = {}
        self._route_models: dict[RouteKind, tuple[str, ...]] = {}
        self._not_alone: frozenset[str] | None = None  # decode workers that cannot answer alone
        self._addresses: tuple[str, ...] | None = None  # cached like _models
        self._snap_version = -1
        self._snap_seq = 0
        self._snap = ClusterSnapshot(version=0, workers=())
        # shared by the snapshots whose workers differ in nothing but in-flight counts and load
        # (`policies.snapshot.Layout`): the policy keeps its split of the pool by role across them
        self._layout = Layout()
        self._snap_index: dict[str, int] = {}
        # workers whose in-flight counts moved since the last snapshot: per request, only their
        # states are copied (two, for a P/D request), not every worker's rebuilt
        self._moved: set[Worker] = set()
        # workers whose breaker is open: the open -> half-open transition is a matter of time,
        # looked for at each snapshot while there are any
        self._open: set[Worker] = set()
        # told of each worker added and removed (the policy's per-worker state, KV-event
        # subscriptions): `Registry.watch`
        self._watchers: list[MembershipWatcher] = []

    # -- membership ---------------------------------------------------------------------------

    def add(self, worker: Worker) -> None:
        if worker.id in self._workers:
            raise ValueError(f"a worker with id {worker.id!r} already exists")
        worker.breaker = new_breaker(self._breaker, guard=lambda: self._may_eject(worker))
        self._workers[worker.id] = worker
        self.changed()
        for watcher in self._watchers:
            watcher.worker_added(worker)

    def watch(self, watcher: MembershipWatcher) -> None:
        """Tell `watcher` of every worker added or removed from now on."""
        self._watchers.append(watcher)

    def _gone(self, worker: Worker) -> None:
        for watcher in self._watchers:
            watcher.worker_removed(worker)

    async def remove(self, worker_id: str) -> Worker:
        w = self._workers.pop(worker_id)
        self._open.discard(w)
        self._moved.discard(w)
        self._full.discard(worker_id)
        for key in [k for k in self._pair_breakers if worker_id in k.split("|")]:
            del self._pair_breakers[key]
        for key in [k for k in self._suspect_until if worker_id in k.split("|")]:
            del self._suspect_until[key]
        for key in [k for k in self._suspicion if worker_id in k.split("|")]:
            del self._suspicion[key]
        for other in self._workers.values():
            other.failed_partners.pop(worker_id, None)
        self.changed()
        self._gone(w)
        return w

    def get(self, worker_id: str) -> Worker:
        return self._workers[worker_id]

    def find(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def workers(self) -> Iterable[Worker]:
        return self._workers.values()

    def __len__(self) -> int:
        return len(self._workers)

    # -- state ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Bumped by every change but in-flight counts (membership, health, breakers, load)."""
        return self._version

    def changed(self) -> None:
        self._version += 1
        self._models = None
        self._not_serving = {}
        self._route_models = {}
        self._not_alone = None
        self._addresses = None

    def not_serving(self, route: RouteKind) -> frozenset[str]:
        """Ids of the workers whose engine has no such route (SGLang's /generate on a vLLM
        worker): a policy must not pick them for it. A shared empty set in the usual case."""
        out = self._not_serving.get(route)
        if out is None:
            ids = [w.id for w in self._workers.values() if route not in w.adapter.routes]
            out = self._not_serving[route] = frozenset(ids) if ids else _NO_PAIRS
        return out

    def addresses(self) -> tuple[str, ...]:
        """How the workers' addresses may be spelt in a text (their URLs, `host:port`, a
        bootstrap server's `host:port`, their host names): no client answer may carry one
        (gateway/orchestration/public.py). Cached like `not_serving`."""
        out = self._addresses
        if out is None:
            found: set[str] = set()
            for w in self._workers.values():
                found.update((w.url, f"{w.host}:{w.port}", w.id))
                boot = w.bootstrap_port if w.bootstrap_port is not None else w.info.bootstrap_port
                if boot is not None:
                    found.add(f"{w.host}:{boot}")
                if not w.host.replace(".", "").isdigit() and w.host not in ("localhost", "::1"):
                    found.add(w.host)  # a host name (an address in digits is found by its shape)
            out = self._addresses = tuple(sorted(a for a in found if ":" in a or "." in a))
        return out

    def decodes_not_alone(self) -> frozenset[str]:
        """Ids of the decode workers that cannot answer a request by themselves (SGLang's): they
        must not be planned for a request whose answer needs the prompt computed where it is
        answered (`ParsedRequest.local_prefill`). Cached like `not_serving`."""
        out = self._not_alone
        if out is None:
            ids = [
                w.id for w in self._workers.values() if w.role is Role.DECODE and not w.adapter.decode_alone
            ]
            out = self._not_alone = frozenset(ids) if ids else _NO_PAIRS
        return out

    def models(self) -> tuple[str, ...]:
        """The models some worker serves (cached: per request it is a lookup, not a scan)."""
        models = self._models
        if models is None:
            models = self._models = tuple(
                sorted({w.model for w in self._workers.values() if w.model is not None})
            )
        return models

    def models_for(self, route: RouteKind) -> tuple[str, ...]:
        """The models some worker serves on `route` (SGLang's /generate: only SGLang workers'),
        which a request naming no model may default to. Cached like `models`."""
        out = self._route_models.get(route)
        if out is None:
            served = {
                w.model for w in self._workers.values() if w.model is not None and route in w.adapter.routes
            }
            out = self._route_models[route] = tuple(sorted(served))
        return out

    def snapshot(self) -> ClusterSnapshot:
        """The cluster as policies see it, current to this call. Cheap per request: rebuilt
        whole only after a change other than in-flight counts; otherwise the workers whose
        counts moved get a copied state."""
        if self._open:
            self._half_open_due()
        if self._snap_version != self._version:
            workers = tuple(w.state() for w in self._workers.values())
            self._snap_index = {w.id: i for i, w in enumerate(workers)}
            self._snap_version = self._version
            self._moved.clear()
            if not same_layout(self._snap.workers, workers):  # (a load scrape keeps it)
                self._layout = Layout()
        elif self._moved:
            # copied only where a count differs from the snapshot's: a worker whose request
            # ended before the next began (acquired and released between two snapshots) is
            # back at the counts it shows, and the snapshot stands as it is
            shown = self._snap.workers
            states: list[WorkerState] | None = None
            index = self._snap_index
            for w in self._moved:
                i = index[w.id]
                old = shown[i]
                n = w.inflight + w.foreign_inflight
                tok = w.inflight_tokens + w.foreign_tokens
                if old.inflight != n or old.inflight_tokens != tok:
                    if states is None:
                        states = list(shown)
                    states[i] = _replace(old, inflight=n, inflight_tokens=tok)
            self._moved.clear()
            if states is None:
                return self._snap
            workers = tuple(states)
        else:
            return self._snap
        self._snap_seq += 1
        self._snap = ClusterSnapshot(version=self._snap_seq, workers=workers, layout=self._layout)
        return self._snap

    def _half_open_due(self) -> None:
        """Worker breakers whose open period is over turn half-open (one trial request)."""
        for w in list(self._open):
            if w.breaker.state is not _OPEN:
                self._open.discard(w)
            elif w.breaker.allows():  # the open period is over: now half-open
                self._open.discard(w)
                self.changed()

    def model_label(self, model: str) -> str:
        """`model` if some worker serves it, else "unknown": client-chosen names must not grow
        metric label sets without bound."""
        return model if model in self.models() else "unknown"

    def pair_breaker(self, prefill_id: str, decode_id: str) -> CircuitBreaker:
        key = f"{prefill_id}|{decode_id}"
        b = self._pair_breakers.get(key)
        if b is None:
            b = new_breaker(self._breaker, guard=lambda: self._may_eject_pair(prefill_id, decode_id))
            # not kept for a pair whose worker was removed while the request ran (a worker added
            # again under its id must not inherit it)
            if prefill_id in self._workers and decode_id in self._workers:
                self._pair_breakers[key] = b
        return b

    def _may_eject(self, w: Worker) -> bool:
        """May `w`'s breaker open now (for failures short of `eject_failure_share`)? Only while
        its pool, the workers of its role, engine and model, keeps more than
        `1 - max_ejected_share` of them in routing: a pool of one never loses its worker to a
        partial failure."""
        pool = [
            o
            for o in self._workers.values()
            if o.role is w.role and o.engine is w.engine and o.model == w.model
        ]
        out = sum(1 for o in pool if o is not w and o.breaker.state is not _CLOSED)
        return out + 1 <= self._breaker.max_ejected_share * max(1, len(pool))

    def _may_eject_pair(self, prefill_id: str, decode_id: str) -> bool:
        """The same for a pair's breaker: its pool is every (prefill, decode) pair of the
        prefill's engine and model."""
        p, d = self._workers.get(prefill_id), self._workers.get(decode_id)
        if p is None or d is None:
            return True
        pre = [
            o.id
            for o in self._workers.values()
            if o.role is Role.PREFILL and o.engine is p.engine and o.model == p.model
        ]
        dec = [
            o.id
            for o in self._workers.values()
            if o.role is Role.DECODE and o.engine is d.engine and o.model == d.model
        ]
        out = 0
        for a in pre:
            for b in dec:
                if (a != prefill_id or b != decode_id) and self._pair_ejected(a, b):
                    out += 1
        return out + 1 <= self._breaker.max_ejected_share * max(1, len(pre) * len(dec))

    def _pair_ejected(self, prefill_id: str, decode_id: str) -> bool:
        """Is this pair's breaker out of routing (not closed)? A pair without one never was."""
        b = self._pair_breakers.get(f"{prefill_id}|{decode_id}")
        return b is not None and b.state is not _CLOSED

    def open_pairs(self) -> frozenset[str]:
        """Pair ids ("prefill|decode") whose breaker refuses traffic now.

        Runs once per request: closed breakers (the usual case) always allow and are skipped
        without a call, and no open pair returns a shared empty set."""
        out: list[str] | None = None
        for k, b in self._pair_breakers.items():  # (a loop, not a comprehension: no frame)
            if b.state is not _CLOSED and not b.allows():
                if out is None:
                    out = []
                out.append(k)
        return _NO_PAIRS if out is None else frozenset(out)

    def exclusions(self, route: RouteKind, failed: set[str]) -> frozenset[str]:
        """What a plan must leave out, in one call per request: the ids that failed for this
        request (`failed`), the pairs whose breaker refuses traffic now (`open_pairs`), the
        workers at their in-flight cap (`full`) and those without `route` (`not_serving`). A
        shared empty set in the usual case."""
        opened = self.open_pairs()
        full = self.full()
        unable = self._not_serving.get(route)
        if unable is None:
            unable = self.not_serving(route)
        if not failed and not full and not unable:
            return opened  # (the shared empty set when no pair is open)
        return frozenset(failed).union(opened, full, unable)

    def pair_states(self) -> list[tuple[str, str, BreakerState]]:
        """(prefill id, decode id, breaker state) of every pair the gateway keeps a breaker for
        (one that has carried a request), for the admin API and metrics: a pair's open breaker
        takes a route away although both its workers are usable on their own. An open breaker
        whose open period is over shows half-open (its next request is the trial)."""
        out = []
        for key, b in self._pair_breakers.items():
            b.allows()  # (the open -> half-open move that is due by now)
            prefill, _, decode = key.partition("|")
            out.append((prefill, decode, b.state))
        return out

    def mark_suspect(self, pair_id: str, window_s: float) -> None:
        """A handoff on this pair failed a KV-integrity check: suspect it for `window_s` (renewed
        by each new failure). Suspect pairs get their answers verified before delivery.

        A pair that fails again within one window of its last suspicion's end (a corruption
        that comes and goes, or one too rare to recur within the window) is suspected for twice
        its last window, up to `SUSPECT_ESCALATION` times `window_s`; one that stayed clean for
        a whole window after it starts again at `window_s`."""
        if window_s <= 0 or not all(wid in self._workers for wid in pair_id.split("|")):
            return
        now = time.monotonic()
        window = window_s
        last = self._suspicion.get(pair_id)
        if last is not None:
            last_window, ended = last
            if now < ended:  # still suspect: renewed for its current window
                window = last_window
            elif now - ended < last_window:  # back within one window of the end: escalated
                window = min(2 * last_window, SUSPECT_ESCALATION * window_s)
        self._suspect_until[pair_id] = now + window
        self._suspicion[pair_id] = (window, now + window)
        self.suspect_epoch += 1

    def suspect_pairs(self) -> frozenset[str]:
        """Pair ids under suspicion now (expired ones are dropped); one dict check per request
        while there are none."""
        if not self._suspect_until:
            return _NO_PAIRS
        now = time.monotonic()
        for k in [k for k, until in self._suspect_until.items() if until <= now]:
            del self._suspect_until[k]
        return frozenset(self._suspect_until) if self._suspect_until else _NO_PAIRS

    def acquire(self, w: Worker, tokens: int) -> None:
        w.inflight += 1
        w.inflight_tokens += tokens
        if self._workers.get(w.id) is not w:
            return  # removed (or replaced under its id) since it was planned: not in snapshots
        b = w.breaker
        # the one trial request of a half-open breaker: the snapshot shows it unusable (a closed
        # breaker, the usual case, is not asked: its `on_dispatch` is False)
        if b.state is _HALF_OPEN and b.on_dispatch():
            self.changed()
        self._moved.add(w)
        if self.inflight_cap and w.inflight >= self.inflight_cap:
            self._full.add(w.id)

    def release(self, w: Worker, tokens: int) -> None:
        w.inflight -= 1
        w.inflight_tokens -= tokens
        if self._workers.get(w.id) is not w:
            # removed while this request ran (admin remove does not cut requests): it has no
            # place in snapshots any more, and a worker added since under its id is another one
            return
        self._moved.add(w)
        if self._full and w.inflight < self.inflight_cap:
            self._full.discard(w.id)

    def full(self) -> set[str]:
        """Workers at their in-flight cap (the KV-transfer cliff under concurrency, sglang #9266)."""
        return self._full

    def inflight_of(self, w: Worker) -> tuple[int, int]:
        """(requests, tokens) the gateway has in flight on `w` now: this process's, and with
        several processes every one's (the admin API's figures)."""
        return w.inflight, w.inflight_tokens

    def record(self, w: Worker, ok: bool | None) -> None:
        """One request's outcome on `w`: True, False, or None for no verdict (see
        CircuitBreaker.record)."""
        b = w.breaker
        if ok and b.state is _CLOSED:
            # the usual outcome: a success on a closed breaker moves no state, whether or not
            # the worker is still registered (the two ways below, for it). (A breaker whose
            # state another process moved meanwhile: the shared table's generation tells this
            # registry at its next snapshot, as for any move made there.)
            b.record(True)
            return
        if self._workers.get(w.id) is not w:
            b.record(ok)  # removed while the request ran: its own breaker only
            return
        trial = b.state is _HALF_OPEN  # a trial ended: the next may go
        if b.record(ok) or trial:
            if b.state is _OPEN:
                self._open.add(w)
            self.changed()

    def record_pair(
        self,
        p: Worker,
        d: Worker,
        pair: CircuitBreaker,
        ok: bool | None,
        *,
        suspects: tuple[Worker, ...] = (),
        request: object = None,
    ) -> None:
        """One handoff's verdict on the (p, d) pair (`pair`: its breaker). A handoff that fails
        between two workers is the pair's failure, not either worker's (one bad link, or a decode
        refusing one prefill's KV, must not take a worker out of every other pair); but a worker
        whose handoffs failed with two or more different partners, for two or more different
        requests, and went well with none since, is the broken one: each such failure then counts
        against its own breaker too. Without this a decode answering every handoff with a 5xx
        cost N prefills x failure_threshold failed requests before it was avoided.
        `suspects`: the workers this failure may be held against (those whose own leg did not
        go well), none when it is no worker's (already blamed on one, provoked by the request,
        a deadline); `request`: the request's key (one request's own retries on other pairs are
        one request, whatever it provokes)."""
        if pair.record(ok):
            self.changed()
        if ok is None:
            return
        if ok:
            if p.failed_partners:
                p.failed_partners.clear()
            if d.failed_partners:
                d.failed_partners.clear()
            return
        for w in suspects:
            other = d if w is p else p
            failed = w.failed_partners
            failed[other.id] = request
            if len(failed) >= 2 and len(set(failed.values())) >= 2:
                self.record(w, False)

    async def close(self) -> None:
        for w in self._workers.values():
            await w.pool.close()


__all__ = ["MembershipWatcher", "Registry", "Worker", "new_breaker"]
