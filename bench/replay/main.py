"""`pd-gateway bench replay`: replay a trace against front ends on identical fresh clusters.

    pd-gateway bench replay --trace mooncake.jsonl --slice 3600:3900 --rates 0.5,1 \\
        --engine sglang --colocated 4 --time-scale 0.5 --repeats 3 \\
        --target direct --target gateway:round_robin --target gateway:least_load \\
        --target sglang-router:cache_aware --target vllm-router:cache_aware

For every load (rate multiplier, or closed-loop concurrency), every repeat and every target
(in an order rotated each repeat): a fresh cluster (cold caches), the target, a few tiny
warm-up requests through it, then the replay; the engines' counters and the target's CPU are
read around it. Relative SLOs ('5x') come from a calibration pass first: a few prompt lengths,
one request at a time, straight to an idle cluster. Ctrl-C stops the run: what finished is
reported (marked partial) and every process is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import os
import platform
import resource
import shlex
import signal
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import procs
from bench.loadgen import vllm_prefill_dict
from bench.replay import client as rc
from bench.replay import prompts, reference, report, synthetic, trace
from bench.replay.cluster import Cluster, ClusterSpec, start_cluster
from bench.replay.stats import Calibration, Record, Slo, summarize
from bench.replay.targets import RunningTarget, TargetSpec, start_target

RESULTS_DIR = procs.REPO_ROOT / "bench" / "results"
DEFAULT_TARGETS = ("direct", "gateway:round_robin", "gateway:least_load")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pd-gateway bench replay",
        description="Replay a trace against routers on identical fresh clusters: goodput under "
        "SLOs, latency percentiles, cache hit rates and load spread, with reports and plots.",
    )
    g = p.add_argument_group("input")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--trace",
        help="Mooncake JSONL or CSV (timestamp_ms,input_length,output_length[,hash_ids][,session_id])",
    )
    src.add_argument("--synthetic", choices=synthetic.KINDS, help="a generated workload instead")
    g.add_argument("--slice", default=None, metavar="START:END", help="rows [START, END) of the input")
    g.add_argument("--synthetic-requests", type=int, default=200)
    g.add_argument(
        "--synthetic-rate", type=float, default=2.0, help="mean requests/s of the generated workload"
    )
    g.add_argument(
        "--synthetic-user-tokens", type=int, default=512, help="mean own prompt tokens of a generated request"
    )
    g.add_argument(
        "--synthetic-output-tokens", type=int, default=128, help="mean output tokens of a generated request"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json for real engines ('bytes': the emulator's)"
    )
    g.add_argument("--tokenize-url", default=None, help="build prompts with this engine's POST /tokenize")
    g.add_argument(
        "--prompt-salt", default="", help="changes every block's content (fresh prompts on given engines)"
    )

    g = p.add_argument_group("load")
    g.add_argument("--rates", default="1", help="open loop: arrival-rate multipliers, comma-separated")
    g.add_argument(
        "--concurrency", default=None, help="closed loop instead: concurrent clients, comma-separated"
    )
    g.add_argument("--repeats", type=int, default=1)
    g.add_argument("--warmup-requests", type=int, default=2, help="tiny requests through each target first")
    g.add_argument(
        "--warmup-s", type=float, default=0.0, help="requests due in the first S seconds are not measured"
    )
    g.add_argument("--duration-s", type=float, default=None, help="send no request after S seconds")
    g.add_argument("--drain-s", type=float, default=600.0, help="then wait at most S seconds for the rest")
    g.add_argument("--request-timeout-s", type=float, default=1800.0)
    g.add_argument("--no-progress", action="store_true")

    g = p.add_argument_group("cluster")
    g.add_argument("--engine", choices=["sglang", "vllm"], default="sglang")
    g.add_argument("--colocated", type=int, default=0, metavar="N", help="N colocated emulated workers")
    g.add_argument("--prefill", type=int, default=0, metavar="P", help="P emulated prefill workers")
    g.add_argument("--decode", type=int, default=0, metavar="D", help="D emulated decode workers")
    g.add_argument("--profile", default="llama-3-8b-h100", help="emulator profile (emulator/profiles.py)")
    g.add_argument("--time-scale", type=float, default=1.0, help="emulator: multiplies every modelled delay")
    g.add_argument("--max-model-len", type=int, default=262144)
    g.add_argument("--max-total-tokens", type=int, default=None, help="emulator KV pool per worker (tokens)")
    g.add_argument(
        "--emulator-arg", action="append", default=[], help="passed to every emulator (repeatable)"
    )
    g.add_argument(
        "--kv-events",
        action="store_true",
        help="emulators publish KV events; gateway targets subscribe (bench/replay/targets.py)",
    )
    g.add_argument("--model", default=None, help="model name (emulated: replay-model)")
    g.add_argument("--worker-url", action="append", default=[], help="a running colocated engine")
    g.add_argument("--prefill-url", action="append", nargs="+", default=[], metavar="URL [BOOTSTRAP_PORT]")
    g.add_argument("--decode-url", action="append", default=[])

    g = p.add_argument_group("targets and SLOs")
    g.add_argument(
        "--target",
        action="append",
        default=[],
        help="KIND[:POLICY] or LABEL='KIND ARGS...' (kinds: direct, gateway, sglang-router, "
        f"vllm-router); default: {', '.join(DEFAULT_TARGETS)}",
    )
    g.add_argument(
        "--slo-ttft", default="5x", help="seconds ('2', '500ms') or a multiple of the unloaded TTFT ('5x')"
    )
    g.add_argument("--slo-tpot", default="5x", help="likewise for the time per output token")
    g.add_argument("--calibrate-points", type=int, default=6, help="prompt lengths in the calibration pass")

    g = p.add_argument_group("output")
    g.add_argument("--out", default=None, help="results folder (default bench/results/replay-<time>)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument(
        "--reference-only", action="store_true", help="print the simulated reachable reuse and stop"
    )
    return p


def parse_list(text: str, kind: type) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"pd-gateway bench replay: bad list {text!r}") from None


def load_rows(args: argparse.Namespace) -> tuple[list[trace.Row], str]:
    if args.trace:
        rows = trace.load(args.trace)
        desc = Path(args.trace).name
    else:
        rows = synthetic.generate(
            synthetic.SynthSpec(
                args.synthetic,
                requests=args.synthetic_requests,
                rate=args.synthetic_rate,
                seed=args.seed,
                user_tokens=args.synthetic_user_tokens,
                output_tokens=args.synthetic_output_tokens,
            )
        )
        desc = (
            f"synthetic {args.synthetic} (seed {args.seed}, {args.synthetic_rate:g} req/s, mean own prompt "
            f"{args.synthetic_user_tokens} and output {args.synthetic_output_tokens} tokens)"
        )
    if args.slice:
        a, _, b = args.slice.partition(":")
        start, end = int(a or 0), int(b) if b else None
        rows = trace.select(rows, start, end)
        desc += f" rows {args.slice}"
    if not rows:
        raise SystemExit("pd-gateway bench replay: the slice is empty")
    return rows, desc


def cluster_spec(args: argparse.Namespace) -> ClusterSpec:
    prefill = []
    for item in args.prefill_url:
        if len(item) > 2:
            raise SystemExit("--prefill-url takes URL [BOOTSTRAP_PORT]")
        port = int(item[1]) if len(item) == 2 and item[1] != "none" else None
        prefill.append(rc.PrefillAddr(item[0], port))
    spec = ClusterSpec(
        engine=args.engine,
        colocated=args.colocated,
        prefill=args.prefill,
        decode=args.decode,
        profile=args.profile,
        time_scale=args.time_scale,
        max_model_len=args.max_model_len,
        max_total_tokens=args.max_total_tokens,
        emulator_args=list(args.emulator_arg),
        kv_events=args.kv_events,
        worker_urls=list(args.worker_url),
        prefill_urls=prefill,
        decode_urls=list(args.decode_url),
    )
    if args.model:
        spec.model = args.model
    if spec.given and (args.colocated or args.prefill or args.decode):
        raise SystemExit("pd-gateway bench replay: give emulated worker counts or URLs, not both")
    try:
        spec.check()
    except ValueError as exc:
        raise SystemExit(f"pd-gateway bench replay: {exc}") from None
    return spec


def make_tokenizer(args: argparse.Namespace, spec: ClusterSpec) -> prompts.PromptTokenizer:
    if args.tokenize_url:
        return prompts.RemoteTokenizer(args.tokenize_url, spec.model)
    if args.tokenizer and args.tokenizer != "bytes":
        return prompts.HFTokenizer(args.tokenizer)
    if spec.given and args.tokenizer != "bytes":
        raise SystemExit(
            "pd-gateway bench replay: real engines need --tokenizer tokenizer.json or --tokenize-url URL "
            "(or --tokenizer bytes for emulators given by URL)"
        )
    return prompts.ByteTokenizer()


def build_items(
    rows: Sequence[trace.Row], builder: prompts.PromptBuilder, spec: ClusterSpec, direct_vllm_pd: bool
) -> list[rc.Item]:
    items = []
    for i, row in enumerate(rows):
        text = builder.text(row)
        builder.check(row, text)
        body = rc.request_dict(spec.model, text, row)
        pbody = rc.encode(vllm_prefill_dict(body)) if direct_vllm_pd else None
        items.append(rc.Item(i, row, rc.encode(body), pbody))
    return items


class Stopper:
    """First Ctrl-C: stop sending, let the run end and report what finished. Second: cancel the
    run at once (its processes are still stopped, by the cancellation unwinding their groups).
    Third: the usual KeyboardInterrupt."""

    def __init__(self) -> None:
        self.stopped = False
        self.hard = False
        self.event: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.task: asyncio.Future[None] | None = None
        self._old: Any = None

    def install(self) -> None:
        self._old = signal.signal(signal.SIGINT, self._handle)

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.hard or (self.stopped and (self.task is None or self.loop is None)):
            raise KeyboardInterrupt
        if self.stopped:
            self.hard = True
            print("\ncancelling the run (Ctrl-C again to abort)", file=sys.stderr)
            assert self.loop is not None and self.task is not None
            self.loop.call_soon_threadsafe(self.task.cancel)
            return
        self.stopped = True
        print("\nstopping: finishing up and writing what ran (Ctrl-C again to abort)", file=sys.stderr)
        if self.event is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.event.set)


def _dispatcher(target: RunningTarget, cluster: Cluster) -> rc.Dispatcher:
    if target.url is not None:
        return rc.FrontEnd(target.url)
    # a mixed cluster (colocated and a P/D pool) is measured through its P/D pool (calibration:
    # the SLOs' unloaded figures); the direct baseline is refused there before anything starts
    mixed = cluster.spec.shape == "mixed"
    return rc.Direct(
        cluster.spec.engine,
        [] if mixed else [w.url for w in cluster.colocated],
        cluster.prefill_addrs(),
        [w.url for w in cluster.decode],
    )


def _tiny_items(
    builder: prompts.PromptBuilder, spec: ClusterSpec, n: int, tag: int, vllm_pd: bool
) -> list[rc.Item]:
    items = []
    for k in range(n):
        row = trace.Row(0.0, 64, 2, (-(1 << 40) - tag * 1000 - k,))
        body = rc.request_dict(spec.model, builder.text(row), row)
        pbody = rc.encode(vllm_prefill_dict(body)) if vllm_pd else None
        items.append(rc.Item(-1, row, rc.encode(body), pbody))
    return items


async def warm_up(dispatch: rc.Dispatcher, items: Sequence[rc.Item], deadline_s: float = 90.0) -> None:
    """Send each tiny request until it succeeds (a router may still be finding its workers)."""
    end = time.monotonic() + deadline_s
    for item in items:
        while True:
            rec = Record(index=-1, input_length=item.row.input_length, output_length=2)
            with contextlib.suppress(ConnectionError, OSError, TimeoutError):
                await asyncio.wait_for(dispatch.send(item, rec), 30.0)
            if rec.ok:
                break
            if time.monotonic() > end:
                raise RuntimeError(f"the target never answered a warm-up request: {rec.error or rec.status}")
            await asyncio.sleep(0.5)


def _client_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def calibrate(
    cluster: Cluster, builder: prompts.PromptBuilder, rows: Sequence[trace.Row], points: int, vllm_pd: bool
) -> Calibration:
    """Unloaded TTFT/TPOT at a few lengths spanning the rows, one request at a time, nothing cached."""
    lengths = sorted(r.input_length for r in rows)
    grid = sorted({lengths[min(len(lengths) - 1, round(q * (len(lengths) - 1)))] for q in _spaced(points)})
    dispatch = _dispatcher(RunningTarget(TargetSpec("direct", "direct"), None), cluster)
    await warm_up(dispatch, _tiny_items(builder, cluster.spec, 1, 999, vllm_pd))
    out = Calibration([], [], [])
    try:
        for k, length in enumerate(grid):
            row = trace.Row(
                0.0,
                length,
                16,
                tuple(-(1 << 41) - k * 100000 - j for j in range(trace.blocks_needed(length))),
            )
            body = rc.request_dict(cluster.spec.model, builder.text(row), row)
            pbody = rc.encode(vllm_prefill_dict(body)) if vllm_pd else None
            rec = Record(index=-1, input_length=length, output_length=16)
            await dispatch.send(rc.Item(-1, row, rc.encode(body), pbody), rec)
            if not rec.ok:
                raise RuntimeError(
                    f"calibration request of {length} tokens failed: {rec.error or rec.status}"
                )
            out.lengths.append(length)
            out.ttft_s.append(rec.ttft)
            out.tpot_s.append(rec.tpot)
    finally:
        dispatch.close()
    return out


def _spaced(points: int) -> list[float]:
    points = max(2, points)
    return [k / (points - 1) for k in range(points)]


async def one_run(
    *,
    spec: ClusterSpec,
    target_spec: TargetSpec,
    items: Sequence[rc.Item],
    warm: Sequence[rc.Item],
    rate: float | None,
    concurrency: int | None,
    args: argparse.Namespace,
    stopper: Stopper,
    log_dir: Path,
    desc: str,
) -> tuple[list[Record], dict[str, Any]]:
    with procs.process_group() as group:
        cluster = start_cluster(group, spec, log_dir)
        target = start_target(group, target_spec, cluster, log_dir)
        dispatch = _dispatcher(target, cluster)
        try:
            await warm_up(dispatch, warm)
            before = cluster.counters()
            fe0, cl0, me0 = target.cpu_seconds(), cluster.cpu_seconds(), _client_cpu()
            assert stopper.event is not None
            ctl = rc.RunControl(
                stop=stopper.event,
                duration_s=args.duration_s,
                drain_s=args.drain_s,
                request_timeout_s=args.request_timeout_s,
                warmup_s=args.warmup_s,
            )
            bar = rc.progress_bar(len(items), desc, not args.no_progress)
            try:
                if concurrency is not None:
                    records = await rc.closed_loop(
                        items, dispatch, ctl, concurrency=concurrency, progress=bar
                    )
                else:
                    records = await rc.open_loop(items, dispatch, ctl, rate=rate or 1.0, progress=bar)
            finally:
                bar.close()
            extra = {
                "frontend_cpu_s": target.cpu_seconds() - fe0,
                "cluster_cpu_s": cluster.cpu_seconds() - cl0,
                "client_cpu_s": _client_cpu() - me0,
                "argv": target.argv,
            }
            after = cluster.counters()
            _save_policy_metrics(target, log_dir, desc)
            extra["workers"] = {
                w.name: report.WorkerLoad(w.role, after[w.name].minus(before[w.name]))
                for w in cluster.workers
            }
        finally:
            dispatch.close()
    return records, extra


def _save_policy_metrics(target: RunningTarget, log_dir: Path, desc: str) -> None:
    """A gateway's own policy figures at the end of a run, kept beside its logs: the decider's
    verdicts, learned rates, fallbacks and verification re-runs (`pdgw_shadow_*`, `pdgw_guard_*`)
    and its KV-event index's health (`pdgw_kv_index_*`: state, gaps, lag) as `<run>.metrics.txt`
    (what it chose and checked), and its
    `pdgw_cache_*` metrics (what its cache-aware policy predicted against what the engines
    reported, per worker) as `LABEL-pdgw_cache-N.prom`."""
    if target.spec.kind != "gateway" or target.url is None:
        return
    try:
        with urllib.request.urlopen(target.url + "/metrics", timeout=10.0) as resp:
            text = resp.read().decode("utf-8", "replace")
    except OSError:
        return
    lines = text.splitlines()
    keep = [
        ln
        for ln in lines
        if ln.startswith(
            ("pdgw_decider", "pdgw_fallbacks", "pdgw_requests", "pdgw_shadow", "pdgw_guard", "pdgw_kv_index")
        )
    ]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in desc)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / f"{name}.metrics.txt").write_text("\n".join(keep) + "\n")
    cache = [ln for ln in lines if ln.startswith(("pdgw_cache_", "# HELP pdgw_cache_"))]
    if not cache:
        return
    stem = target.spec.label.replace("/", "_").replace(":", "_")
    n = sum(1 for _ in log_dir.glob(f"{stem}-pdgw_cache-*.prom"))
    (log_dir / f"{stem}-pdgw_cache-{n}.prom").write_text("\n".join(cache) + "\n")


def _spread(workers: dict[str, report.WorkerLoad]) -> tuple[float, float]:
    pre = [w.counters for w in workers.values() if w.role != "decode"]
    prompt = sum(c.prompt_tokens for c in pre)
    hit = sum(c.cached_tokens for c in pre) / prompt if prompt else float("nan")
    computed = [c.computed_tokens for c in pre]
    mean = statistics.mean(computed) if computed else 0.0
    return hit, (max(computed) / mean if mean > 0 else float("nan"))


def reachable(
    rows: Sequence[trace.Row], spec: ClusterSpec, capacities: Sequence[int], rate: float
) -> list[reference.SimResult]:
    scaled = trace.scale_arrivals(rows, rate)
    cost = reference.emulator_prefill_time(spec.profile, spec.time_scale)
    return [
        reference.simulate(scaled, "ideal"),
        reference.simulate(scaled, "cache_first", capacity_tokens=capacities, prefill_time=cost),
        reference.simulate(scaled, "reference", capacity_tokens=capacities, prefill_time=cost),
        reference.simulate(scaled, "round_robin", capacity_tokens=capacities),
    ]


def conditions() -> dict[str, Any]:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        cpus = os.cpu_count() or 0
    return {
        "host": platform.node(),
        "python": platform.python_version(),
        "cpus": cpus,
        "loadavg_at_start": list(os.getloadavg()),
    }


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    spec = cluster_spec(args)
    try:
        targets = [TargetSpec.parse(t) for t in (args.target or DEFAULT_TARGETS)]
        for t in targets:
            t.check(spec.shape, spec.engine)
        ttft_slo, tpot_slo = Slo.parse(args.slo_ttft), Slo.parse(args.slo_tpot)
        rows, desc = load_rows(args)
    except (ValueError, OSError) as exc:
        print(f"pd-gateway bench replay: {exc}", file=sys.stderr)
        return 2
    if len({t.label for t in targets}) != len(targets):
        print("pd-gateway bench replay: two targets have the same label", file=sys.stderr)
        return 2
    concurrency = parse_list(args.concurrency, int) if args.concurrency else None
    rates = None if concurrency else parse_list(args.rates, float)
    started = dt.datetime.now(dt.UTC)
    out = Path(args.out) if args.out else RESULTS_DIR / f"replay-{started:%Y%m%d-%H%M%S}"
    log_dir = out / "logs"
    tok = make_tokenizer(args, spec)
    builder = prompts.PromptBuilder(tok, salt=args.prompt_salt)
    vllm_pd = spec.engine == "vllm" and spec.shape == "pd"
    print(f"building {len(rows)} prompts ({tok.name}) ...", file=sys.stderr)
    try:
        items = build_items(rows, builder, spec, vllm_pd)
    except prompts.LengthMismatch as exc:
        print(f"pd-gateway bench replay: {exc}", file=sys.stderr)
        return 2
    stopper = Stopper()
    stopper.install()
    try:
        return _run(
            args,
            spec,
            targets,
            rows,
            desc,
            items,
            builder,
            ttft_slo,
            tpot_slo,
            rates,
            concurrency,
            started,
            out,
            log_dir,
            stopper,
        )
    finally:
        stopper.restore()


def _run(
    args: argparse.Namespace,
    spec: ClusterSpec,
    targets: list[TargetSpec],
    rows: list[trace.Row],
    desc: str,
    items: list[rc.Item],
    builder: prompts.PromptBuilder,
    ttft_slo: Slo,
    tpot_slo: Slo,
    rates: list[float] | None,
    concurrency: list[int] | None,
    started: dt.datetime,
    out: Path,
    log_dir: Path,
    stopper: Stopper,
) -> int:
    vllm_pd = spec.engine == "vllm" and spec.shape == "pd"
    rep = report.Report(
        command="pd-gateway bench replay "
        + shlex.join(sys.argv[3:] if sys.argv[1:3] == ["bench", "replay"] else sys.argv[1:]),
        started=started.isoformat(timespec="seconds"),
        conditions=conditions(),
        cluster=spec.label() + ("" if spec.given else f", {spec.profile}, time scale {spec.time_scale:g}"),
        input=desc,
        rows=len(rows),
        slo_ttft=str(ttft_slo),
        slo_tpot=str(tpot_slo),
        calibration=None,
        reachable={},
        runs=[],
        targets=[t.label for t in targets],
    )
    loop = _new_loop()
    stopper.loop = loop
    stopper.event = None

    async def body() -> None:
        stopper.event = asyncio.Event()
        if stopper.stopped:
            stopper.event.set()
        # one idle cluster: the workers' KV capacities, and the calibration pass
        with procs.process_group() as group:
            cluster = start_cluster(group, spec, log_dir)
            caps = cluster.kv_capacity_tokens()
            capacities = [
                c or 0
                for n, c in caps.items()
                if any(w.name == n and w.computes_prefill for w in cluster.workers)
            ]
            if ttft_slo.relative or tpot_slo.relative:
                print("calibrating unloaded TTFT/TPOT ...", file=sys.stderr)
                rep.calibration = await calibrate(cluster, builder, rows, args.calibrate_points, vllm_pd)
        loads: list[tuple[str, float | None, int | None]] = (
            [(f"rate x{r:g}", r, None) for r in rates]
            if rates
            else [(f"concurrency {c}", None, c) for c in concurrency or []]
        )
        for label, rate, _ in loads:
            rep.reachable[label] = reachable(rows, spec, capacities, rate or 1.0) if all(capacities) else []
            print(label + report._reach(rep.reachable[label]), file=sys.stderr)
        if args.reference_only:
            return
        n = 0
        for li, (label, rate, conc) in enumerate(loads):
            for repeat in range(args.repeats):
                shift = (repeat + li) % len(targets)
                order = targets[shift:] + targets[:shift]
                for pos, t in enumerate(order):
                    if stopper.stopped:
                        rep.partial = True
                        return
                    n += 1
                    d = f"{label} {t.label} {repeat + 1}/{args.repeats}"
                    warm = _tiny_items(builder, spec, args.warmup_requests, n, vllm_pd)
                    try:
                        records, extra = await one_run(
                            spec=spec,
                            target_spec=t,
                            items=items,
                            warm=warm,
                            rate=rate,
                            concurrency=conc,
                            args=args,
                            stopper=stopper,
                            log_dir=log_dir,
                            desc=d,
                        )
                    except (procs.ProcessDied, RuntimeError, TimeoutError, OSError) as exc:
                        # a target that cannot start or serve is a finding, not the end of the run
                        why = f"{type(exc).__name__}: {str(exc).strip()[:600]}"
                        rep.failures.append(report.Failure(t.label, label, repeat, why))
                        print(f"{d}: FAILED {why}", file=sys.stderr)
                        report.write(rep, out, plots=False)
                        continue
                    summary = summarize(records, ttft_slo, tpot_slo, rep.calibration)
                    hit, spread = _spread(extra["workers"])
                    rep.runs.append(
                        report.RunResult(
                            target=t.label,
                            kind=t.kind,
                            load=label,
                            rate=rate,
                            concurrency=conc,
                            repeat=repeat,
                            position=pos,
                            summary=summary,
                            hit_rate=hit,
                            load_spread=spread,
                            workers=extra["workers"],
                            frontend_cpu_s=extra["frontend_cpu_s"],
                            cluster_cpu_s=extra["cluster_cpu_s"],
                            client_cpu_s=extra["client_cpu_s"],
                            partial=stopper.stopped,
                            argv=extra["argv"],
                            records=records,
                        )
                    )
                    print(
                        f"{d}: goodput {summary.goodput_rps:.2f} req/s, SLO met {summary.slo_attainment:.0%}, "
                        f"TTFT p50 {summary.ttft_s['p50']:.2f}s p99 {summary.ttft_s['p99']:.2f}s, hit {hit:.1%}, "
                        f"errors {summary.errors + summary.unfinished}, send lag p99 {summary.send_lag_s['p99'] * 1000:.1f} ms",
                        file=sys.stderr,
                    )
                    report.write(rep, out, plots=False)
        rep.partial = rep.partial or stopper.stopped

    task = loop.create_task(body())
    stopper.task = task
    try:
        loop.run_until_complete(task)
    except (KeyboardInterrupt, asyncio.CancelledError):
        rep.partial = True
    finally:
        stopper.task = None
        loop.close()
    files = report.write(rep, out, plots=not args.no_plots and not args.reference_only)
    print(report.markdown(rep))
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 130 if rep.partial and stopper.stopped else 0


def _new_loop() -> asyncio.AbstractEventLoop:
    from bench.loadgen import new_event_loop

    return new_event_loop()


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main(sys.argv[1:]))
