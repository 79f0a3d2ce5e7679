"""cache_aware's decision time and index memory, with millions of blocks indexed.

For each pool size (8, 100 and 1,000 workers by default) an approximate index is filled with
`--blocks` (worker, block) entries from conversations over shared system prompts, each routed
to a random worker; then `--decisions` requests (half continuing an indexed conversation, half
new) are decided by the colocated role's selector (`CacheAwareSelector.select` over the whole
pool, as `PDPolicy.plan` hands it) and each decision is timed. The request's key chain is
computed before the clock starts (it is made once per request however many workers there are,
and is reported on its own: "keying"). `--precise` does the same against the KV-event index
(engine block hashes, the emulator's scheme), where a request's engine hashes are computed
during the lookup as far as it reads, from the hasher's memo where a prefix was hashed before
("cold"), or were all computed before the clock starts ("warm").

Memory: tracemalloc around building an index of 1,000,000 (block, worker) entries (every
block held by one worker; then with each block held by two), per million entries.

    .venv/bin/python -m bench.cache_decision
    .venv/bin/python -m bench.cache_decision --workers 8,100,1000 --blocks 2000000 --precise
    taskset -c 0 .venv/bin/python -m bench.cache_decision --json /tmp/cache.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.blockhash import HashSpec, make_hasher  # noqa: E402
from bench.code_footprint import footprint  # noqa: E402
from gateway.kvevents.index import KvEventIndex  # noqa: E402
from policies.block_index import BlockIndex  # noqa: E402
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState, LoadSelector  # noqa: E402
from policies.pd import PDPolicy  # noqa: E402
from policies.prompt_key import PromptKey  # noqa: E402
from policies.snapshot import (  # noqa: E402
    ClusterSnapshot,
    Colocated,
    Layout,
    RequestView,
    RouteKind,
    WorkerState,
)
from policies.testing import make_worker  # noqa: E402

BLOCK = 16
VOCAB = 32_000
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux


class Workload:
    """System prompts and conversations (token ids) with a seeded generator."""

    def __init__(self, rng: random.Random, systems: int = 64, system_tokens: int = 1024) -> None:
        self.rng = rng
        self.systems = [[rng.randrange(VOCAB) for _ in range(system_tokens)] for _ in range(systems)]
        self.conversations: list[list[int]] = []

    def new_conversation(self, tokens: int) -> list[int]:
        conv = self.rng.choice(self.systems) + [self.rng.randrange(VOCAB) for _ in range(tokens)]
        self.conversations.append(conv)
        return conv

    def request(self) -> list[int]:
        """Half continue a conversation (a hit), half start one (the system prompt's hit)."""
        if self.conversations and self.rng.random() < 0.5:
            base = self.rng.choice(self.conversations)
        else:
            base = self.rng.choice(self.systems)
        return base + [self.rng.randrange(VOCAB) for _ in range(self.rng.randrange(16, 512))]


def pool(n: int, rng: random.Random) -> list[WorkerState]:
    return [make_worker(f"w{i}", inflight=rng.randrange(0, 8)) for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fill_approx(state: CacheState, workers: list[WorkerState], work: Workload, blocks: int) -> int:
    idx = state.approx
    while idx.entries < blocks:
        ids = work.new_conversation(work.rng.randrange(512, 4096))
        key = PromptKey.from_token_ids(ids)
        assert key is not None
        idx.insert("m", work.rng.choice(workers).id, key, None)
    return idx.entries


def fill_precise(index: KvEventIndex, workers: list[WorkerState], work: Workload, blocks: int) -> int:
    """Entries straight into the index's block index, hashed by the index's own hasher (whose
    memo then holds the most recent prefixes, as an earlier turn's lookup leaves them)."""
    for w in workers:
        index.add_worker(w.id, endpoint="tcp://bench:1", scheme="emulator", block_size=BLOCK)
        index.set_state(w.id, "live")
    group = next(iter(index._groups.values()))
    hasher = group.hasher
    total = 0
    while total < blocks:
        ids = work.new_conversation(work.rng.randrange(512, 4096))
        key = PromptKey.from_token_ids(ids)
        assert key is not None
        keys = key.engine_keys(hasher, len(ids) // BLOCK)
        slot = group.slot_of[work.rng.choice(workers).id]
        total += group.index.add(slot, keys)
    return total


class SimClock:
    """The policy's clock: time moves on as requests arrive (`churn`), not as the bench runs."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def churn(
    sel: CacheAwareSelector, workers: list[WorkerState], chosen: WorkerState, rng: random.Random
) -> None:
    """Between two decisions, what a running gateway changes (untimed; the next decision pays
    for catching up with it): the chosen worker's queue grows (its `Routed`), and two workers'
    in-flight counts move (a request starting, one ending: new `WorkerState`s in the pool)."""
    queues = sel.state.queues
    clock = sel.state.clock
    queues.add(chosen.id, rng.randrange(256, 4096), clock())
    if isinstance(clock, SimClock):  # requests arrive at 70 % of what the pool prefills
        clock.t += 2176 / (0.7 * len(workers) * queues.prior)
    for _ in range(2):
        i = rng.randrange(len(workers))
        w = workers[i]
        workers[i] = msgspec.structs.replace(w, inflight=max(0, w.inflight + rng.choice((-1, 1))))


def _switches() -> int:
    """Context switches of this thread so far (voluntary and not); 0 where not reported."""
    if _RUSAGE_THREAD is None:
        return 0
    r = resource.getrusage(_RUSAGE_THREAD)
    return r.ru_nvcsw + r.ru_nivcsw


def time_decisions(
    sel: CacheAwareSelector,
    workers: list[WorkerState],
    work: Workload,
    n: int,
    *,
    warm_engine: bool,
    switched: list[bool] | None = None,
    plan: PDPolicy | None = None,
    layout: Layout | None = None,
    again: list[float] | None = None,
    evict: bytearray | None = None,
) -> tuple[list[float], list[float], list[float]]:
    """(decision CPU µs, decision wall µs, keying CPU µs) per request. CPU time (this thread's)
    leaves out the time other processes held the core, which on a shared machine is most of a
    wall-clock tail, but not what a switch costs the thread when it runs again (its caches
    refilled): `switched` gets, per decision, whether the thread was switched out during it
    (`getrusage(RUSAGE_THREAD)` read before and after, outside the timed part). With `plan`,
    each decision is the policy's whole `plan` of a `ClusterSnapshot` of the pool (made before
    the clock starts) with `layout` (the registry keeps one while only in-flight counts move).
    `again` gets each request's selector decision timed a second time at once (the generator's
    state restored: the same choice), with the caches as the first left them; `evict` is
    written over before each decision (untimed), as other work would refill the caches."""
    rng = random.Random(n)
    decisions: list[float] = []
    walls: list[float] = []
    keying: list[float] = []
    cpu = time.thread_time_ns
    wall = time.perf_counter_ns
    switches = _switches if switched is not None else None
    hasher = make_hasher(HashSpec(scheme="emulator", block_size=BLOCK))
    for i in range(n):
        ids = work.request()
        t0 = cpu()
        key = PromptKey.from_token_ids(ids)
        assert key is not None
        key.approx_chain(BLOCK)
        t1 = cpu()
        if warm_engine:
            key.engine_keys(hasher, len(ids) // BLOCK)
        req = RequestView(f"b{i}", "m", RouteKind.COMPLETIONS, len(ids), 64, prompt_key=key)
        snap = None if plan is None else ClusterSnapshot(version=i, workers=tuple(workers), layout=layout)
        if evict is not None:
            evict[::64] = bytes(len(evict) // 64)
        rng_state = sel.rng.getstate() if again is not None else None
        s0 = 0 if switches is None else switches()
        w0 = wall()
        t2 = cpu()
        if plan is None:
            chosen = sel.select(req, workers)
            t3 = cpu()
        else:
            got = plan.plan(req, snap)  # type: ignore[arg-type]
            t3 = cpu()
            assert isinstance(got, Colocated)
            chosen = got.worker
        w1 = wall()
        if switches is not None and switched is not None:
            switched.append(switches() != s0)
        if again is not None and rng_state is not None:
            sel.rng.setstate(rng_state)
            t4 = cpu()
            sel.select(req, workers)
            again.append((cpu() - t4) / 1000)
        churn(sel, workers, chosen, rng)
        keying.append((t1 - t0) / 1000)
        decisions.append((t3 - t2) / 1000)
        walls.append((w1 - w0) / 1000)
    return decisions, walls, keying


def repeat_one(sel: CacheAwareSelector, workers: list[WorkerState], work: Workload, n: int) -> list[float]:
    """One request decided `n` times: the spread of identical work is the machine's, not the
    decision's (what p99 minus p50 of this says about the others' tails)."""
    ids = work.request()
    req = RequestView(
        "same", "m", RouteKind.COMPLETIONS, len(ids), 64, prompt_key=PromptKey.from_token_ids(ids)
    )
    out: list[float] = []
    for _ in range(n):
        t0 = time.thread_time_ns()
        sel.select(req, workers)
        out.append((time.thread_time_ns() - t0) / 1000)
    return out


def code_per_decision(
    sel: CacheAwareSelector, workers: list[WorkerState], work: Workload, plan: Any
) -> list[float]:
    """(distinct bytecode instructions, functions) of `sel`'s decision or `plan`'s, mean of 50."""
    got = []
    for i in range(50):
        key = PromptKey.from_token_ids(ids := work.request())
        req = RequestView(f"c{i}", "m", RouteKind.COMPLETIONS, len(ids), 64, prompt_key=key)
        key.approx_chain(BLOCK)  # type: ignore[union-attr]
        snap = ClusterSnapshot(i, tuple(workers), None if plan is None else plan[1])
        n, f, made = (
            footprint(sel.select, req, workers) if plan is None else footprint(plan[0].plan, req, snap)
        )
        got.append((n, f))
        churn(sel, workers, made if plan is None else made.worker, random.Random(i))
    return [round(statistics.fmean(g[k] for g in got), 1) for k in (0, 1)]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(statistics.median(values), 1),
        "p99_us": round(percentile(values, 0.99), 1),
        "mean_us": round(statistics.fmean(values), 1),
    }


def measure(state: CacheState, workers: list[WorkerState], rng: random.Random) -> None:
    """Every worker's prefill rate measured (20k work/s, +-10 %), as a gateway that has served a
    while has them: the rates differ, so fewer workers tie."""
    for w in workers:
        state.queues.learn(w.id, 20_000.0 * rng.uniform(0.9, 1.1), 1.0)


def run_pool(
    n: int,
    blocks: int,
    decisions: int,
    seed: int,
    precise: bool,
    measured: bool = False,
    exact: bool = False,
    through_plan: bool = False,
    diagnose: bool = False,
) -> dict[str, Any]:
    rng = random.Random(seed)
    workers = pool(n, rng)
    work = Workload(rng)
    # the exact search refuses the busy-pool price (taken over the whole pool): off with it
    price: dict[str, Any] = {"queue_externality": 0.0} if exact else {}
    settings = CacheAwareSettings(
        block_tokens=BLOCK, max_tree_size=blocks * BLOCK * 2, exact_large_pool=exact, **price
    )
    out: dict[str, Any] = {"workers": n}
    state = CacheState(settings, clock=SimClock())
    if measured:
        measure(state, workers, random.Random(seed + 2))
    t0 = time.perf_counter()
    out["approx_entries"] = fill_approx(state, workers, work, blocks)
    out["fill_s"] = round(time.perf_counter() - t0, 1)
    sel = CacheAwareSelector("colocated", state, rng=random.Random(seed))
    gc.collect()
    gc.freeze()
    time_decisions(sel, workers, work, 200, warm_engine=False)  # warm up
    switched: list[bool] = []
    again: list[float] | None = [] if diagnose else None
    d, w, k = time_decisions(sel, workers, work, decisions, warm_engine=False, switched=switched, again=again)
    out["approx"] = summary(d)
    if again is not None:  # the same decisions at once again, then with 2 and 16 MB evicted first
        out["approx_again"] = summary(again)
        for mb in (2, 16):
            evicted, _, _ = time_decisions(
                sel, workers, work, decisions, warm_engine=False, evict=bytearray(mb << 20)
            )
            out[f"approx_evict_{mb}mb"] = summary(evicted)
    # the decisions the thread ran through without a context switch: what the code costs on a
    # core of its own (on a shared machine a switch refills the caches: tens of µs)
    quiet = [v for v, sw in zip(d, switched, strict=True) if not sw]
    out["approx_unswitched"] = summary(quiet or d)
    out["switched"] = sum(switched)
    out["approx_wall"] = summary(w)
    out["keying"] = summary(k)
    out["noise_floor"] = summary(repeat_one(sel, workers, work, decisions))
    if diagnose:  # the code a decision runs (deterministic): what a cold decision fetches again
        out["code"] = code_per_decision(sel, workers, work, None)
    if through_plan:  # the whole policy: the pool split by role (kept per layout, or not), then `sel`
        policy = PDPolicy("cache_aware", decode=LoadSelector("decode", settings), prefill=sel, colocated=sel)
        for name, layout in (("plan_layout", Layout()), ("plan_no_layout", None)):
            time_decisions(sel, workers, work, 200, warm_engine=False, plan=policy, layout=layout)
            d, _, _ = time_decisions(
                sel, workers, work, decisions, warm_engine=False, plan=policy, layout=layout
            )
            out[name] = summary(d)
            if diagnose:
                out[f"code_{name}"] = code_per_decision(sel, workers, work, (policy, layout))
    gc.unfreeze()
    del state, sel
    if precise:
        gc.collect()
        index = KvEventIndex()
        work = Workload(random.Random(seed + 1))
        out["precise_entries"] = fill_precise(index, workers, work, blocks)
        pstate = CacheState(settings, precise=index, clock=SimClock())
        if measured:
            measure(pstate, workers, random.Random(seed + 2))
        psel = CacheAwareSelector("colocated", pstate, rng=random.Random(seed))
        gc.collect()
        gc.freeze()
        time_decisions(psel, workers, work, 200, warm_engine=True)
        d, _, _ = time_decisions(psel, workers, work, decisions, warm_engine=False)
        out["precise_cold"] = summary(d)
        d, _, _ = time_decisions(psel, workers, work, decisions, warm_engine=True)
        out["precise_warm"] = summary(d)
        gc.unfreeze()
    return out


def hash_cost() -> dict[str, tuple[float, float]]:
    """Per block of 16 tokens, µs: (hashed fresh, remembered by the hasher's memo)."""
    rng = random.Random(2)
    ids = tuple(rng.randrange(VOCAB) for _ in range(16_000))
    out = {}
    for scheme in ("vllm", "sglang", "emulator"):
        h = make_hasher(HashSpec(scheme=scheme, block_size=BLOCK))
        fresh = []
        for _ in range(5):
            h._memo.clear()
            t0 = time.thread_time_ns()
            h.extend(ids, [], None, 1000)
            fresh.append((time.thread_time_ns() - t0) / 1000 / 1000)
            h._memo.clear()
        h.extend(ids, [], None, 1000)
        t0 = time.thread_time_ns()
        h.extend(ids, [], None, 1000)
        out[scheme] = (min(fresh), (time.thread_time_ns() - t0) / 1000 / 1000)
    return out


def memory_per_million(holders: int, slots: int) -> float:
    """Bytes per (block, worker) entry of a BlockIndex of 1,000,000 entries."""
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(1_000_000 // holders)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex()
    ids = [index.new_slot() for _ in range(slots)]
    chunk = 256
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        for s in rng.sample(ids, holders):
            index.add(s, part)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert index.entries == len(keys) * holders
    # the keys list itself was allocated before `before`; the index holds references to its ints,
    # which a real index would own: add them (32 bytes each) so the figure is the index's own
    return (after - before + 32 * len(keys)) / index.entries * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pd-gateway bench cache-decision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="8,100,1000", help="pool sizes, comma separated")
    ap.add_argument("--blocks", type=int, default=2_000_000, help="(worker, block) entries indexed")
    ap.add_argument("--decisions", type=int, default=2000)
    ap.add_argument("--precise", action="store_true", help="also the KV-event index")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument(
        "--large-pool",
        choices=("exact", "sample"),
        default="sample",
        help="cache_aware's large_pool: matches plus a random sample (its default), or the exact search",
    )
    ap.add_argument(
        "--measured",
        action="store_true",
        help="every worker's prefill rate measured (else none yet: all alike)",
    )
    ap.add_argument(
        "--plan",
        action="store_true",
        help="also time the whole policy's plan (PDPolicy: the pool split by role, then the selector)",
    )
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="where the tail comes from: each decision timed again at once, then decisions with 2 and 16 MB"
        " of other memory written before each",
    )
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    results: dict[str, Any] = {"blocks": args.blocks, "block_tokens": BLOCK, "pools": []}
    print(
        f"cache_aware decision time, {args.blocks:,} entries indexed, {args.decisions} decisions per pool"
        " (CPU time of this thread; wall clock in brackets)"
    )
    for n in [int(x) for x in args.workers.split(",")]:
        r = run_pool(
            n,
            args.blocks,
            args.decisions,
            args.seed,
            args.precise,
            args.measured,
            args.large_pool == "exact",
            args.plan,
            args.diagnose,
        )
        results["pools"].append(r)
        line = (
            f"  {n:>5} workers: approx CPU p50 {r['approx']['p50_us']:>6} us  p99 {r['approx']['p99_us']:>6} us"
            f"  (wall p50 {r['approx_wall']['p50_us']} p99 {r['approx_wall']['p99_us']})"
            f"  keying p50 {r['keying']['p50_us']} us"
            f"  [not switched out ({args.decisions - r['switched']}): p50 {r['approx_unswitched']['p50_us']}"
            f" p99 {r['approx_unswitched']['p99_us']}]"
            f"  [one request repeated: p50 {r['noise_floor']['p50_us']} p99 {r['noise_floor']['p99_us']}]"
        )
        if args.diagnose:
            line += (
                f"   each decided again at once: p50 {r['approx_again']['p50_us']} p99 {r['approx_again']['p99_us']};"
                f" 2 MB evicted before each: p50 {r['approx_evict_2mb']['p50_us']} p99 {r['approx_evict_2mb']['p99_us']};"
                f" 16 MB: p50 {r['approx_evict_16mb']['p50_us']} p99 {r['approx_evict_16mb']['p99_us']};"
                f" code run per decision: {r['code'][0]:.0f} distinct instructions in {r['code'][1]:.0f} functions"
            )
            if args.plan:
                line += f" (whole plan, layout kept: {r['code_plan_layout'][0]:.0f} in {r['code_plan_layout'][1]:.0f})"
        if args.plan:
            line += (
                f"   whole plan: p50 {r['plan_layout']['p50_us']} p99 {r['plan_layout']['p99_us']} us"
                f" (no layout kept: p50 {r['plan_no_layout']['p50_us']} p99 {r['plan_no_layout']['p99_us']})"
            )
        if args.precise:
            line += (
                f"   precise warm p50 {r['precise_warm']['p50_us']} p99 {r['precise_warm']['p99_us']} us,"
                f" cold p50 {r['precise_cold']['p50_us']} p99 {r['precise_cold']['p99_us']} us"
            )
        print(line, flush=True)
    hashing = hash_cost()
    results["engine_hash_us_per_block"] = hashing
    for scheme, (fresh, kept) in hashing.items():
        print(f"  engine block hash, {scheme}: {fresh:.2f} us per block of {BLOCK}, {kept:.2f} us remembered")
    if not args.no_memory:
        mem = {
            "one_holder_8_workers": memory_per_million(1, 8),
            "one_holder_1000_workers": memory_per_million(1, 1000),
            "two_holders_8_workers": memory_per_million(2, 8),
        }
        results["memory_bytes_per_million_entries"] = {k: round(v) for k, v in mem.items()}
        for k, v in mem.items():
            print(f"  index memory, {k.replace('_', ' ')}: {v / 1e6:.0f} MB per million entries")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
