"""The workers a replay runs against, and what their own counters say.

A cluster is emulated (`pd-gateway emulate` processes: N colocated, P prefill + D decode, or a
mix, of one engine, profile and time scale; started fresh for every run so that every target
meets cold caches) or given (URLs of running engines: their prefix caches are flushed between
runs, SGLang's `POST /flush_cache`, vLLM's `POST /reset_prefix_cache`).

Counters come from each engine's Prometheus `/metrics`, by the names the engines use
(SGLang 0.5.23: `sglang:num_requests_total`, `sglang:prompt_tokens_total`,
`sglang:cached_tokens_total`, `sglang:max_total_num_tokens`; vLLM 0.32:
`vllm:request_success_total`, `vllm:prompt_tokens_total`, `vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total`, `vllm:cache_config_info`), so the same code reads a real
engine and the emulator.
"""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from bench import procs
from bench.replay.client import PrefillAddr

MODEL = "replay-model"
ROLES = ("both", "prefill", "decode")


@dataclass
class ClusterSpec:
    engine: str = "sglang"
    colocated: int = 0
    prefill: int = 0
    decode: int = 0
    profile: str = "llama-3-8b-h100"
    time_scale: float = 1.0
    max_model_len: int = 262144
    max_total_tokens: int | None = None  # KV pool per worker, tokens (default: the profile's)
    emulator_args: list[str] = field(default_factory=list)
    # emulated workers publish their KV events (`--kv-events`), which gateway targets subscribe to
    kv_events: bool = False
    model: str = MODEL
    worker_urls: list[str] = field(default_factory=list)
    prefill_urls: list[PrefillAddr] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)

    @property
    def given(self) -> bool:
        return bool(self.worker_urls or self.prefill_urls or self.decode_urls)

    def counts(self) -> tuple[int, int, int]:
        if self.given:
            return len(self.worker_urls), len(self.prefill_urls), len(self.decode_urls)
        return self.colocated, self.prefill, self.decode

    def check(self) -> None:
        if self.engine not in ("sglang", "vllm"):
            raise ValueError(f"engine must be sglang or vllm, not {self.engine!r}")
        w, p, d = self.counts()
        if (p == 0) != (d == 0):
            raise ValueError("a P/D pool needs at least one prefill and one decode worker")
        if w + p == 0:
            raise ValueError("the cluster has no workers (--colocated N, or --prefill N --decode N)")
        if self.kv_events and self.given:
            raise ValueError("--kv-events starts emulated workers with KV events: not with given URLs")

    @property
    def shape(self) -> str:
        w, p, _d = self.counts()
        if p == 0:
            return "colocated"
        return "pd" if w == 0 else "mixed"

    def label(self) -> str:
        w, p, d = self.counts()
        parts = [f"{w} colocated"] if w else []
        if p:
            parts.append(f"{p} prefill + {d} decode")
        return f"{self.engine} " + " + ".join(parts)


class Counters(msgspec.Struct):
    requests: float = 0.0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    generation_tokens: float = 0.0

    @property
    def computed_tokens(self) -> float:
        return self.prompt_tokens - self.cached_tokens

    def minus(self, other: Counters) -> Counters:
        return Counters(
            self.requests - other.requests,
            self.prompt_tokens - other.prompt_tokens,
            self.cached_tokens - other.cached_tokens,
            self.generation_tokens - other.generation_tokens,
        )


@dataclass
class Worker:
    name: str
    role: str  # both | prefill | decode
    url: str
    bootstrap_port: int | None = None
    proc: procs.ManagedProcess | None = None
    kv_events: str | None = None  # its KV-event PUB endpoint (the replay socket: the port + 1)

    @property
    def computes_prefill(self) -> bool:
        return self.role in ("both", "prefill")


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by metric name: [(labels, value)]."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _sum(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in samples.get(name, ()))


def counters_from_metrics(engine: str, text: str) -> Counters:
    s = parse_prometheus(text)
    if engine == "sglang":
        return Counters(
            requests=_sum(s, "sglang:num_requests_total"),
            prompt_tokens=_sum(s, "sglang:prompt_tokens_total"),
            cached_tokens=_sum(s, "sglang:cached_tokens_total"),
            generation_tokens=_sum(s, "sglang:generation_tokens_total"),
        )
    return Counters(
        requests=_sum(s, "vllm:request_success_total"),
        prompt_tokens=_sum(s, "vllm:prefix_cache_queries_total") or _sum(s, "vllm:prompt_tokens_total"),
        cached_tokens=_sum(s, "vllm:prefix_cache_hits_total"),
        generation_tokens=_sum(s, "vllm:generation_tokens_total"),
    )


def kv_capacity_from_metrics(engine: str, text: str) -> int | None:
    """The worker's KV pool in tokens, as it reports it."""
    s = parse_prometheus(text)
    if engine == "sglang":
        v = s.get("sglang:max_total_num_tokens")
        return int(v[0][1]) if v else None
    for labels, _ in s.get("vllm:cache_config_info", ()):
        with contextlib.suppress(KeyError, ValueError):
            return int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    return None


def _get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", "replace")


def _post(url: str, timeout: float = 30.0) -> int:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        status: int = resp.status
    return status


@dataclass
class Cluster:
    spec: ClusterSpec
    workers: list[Worker]

    @property
    def colocated(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "both"]

    @property
    def prefill(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "prefill"]

    @property
    def decode(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "decode"]

    def prefill_addrs(self) -> list[PrefillAddr]:
        return [PrefillAddr(w.url, w.bootstrap_port) for w in self.prefill]

    def counters(self) -> dict[str, Counters]:
        return {
            w.name: counters_from_metrics(self.spec.engine, _get(w.url + "/metrics")) for w in self.workers
        }

    def kv_capacity_tokens(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for w in self.workers:
            try:
                out[w.name] = kv_capacity_from_metrics(self.spec.engine, _get(w.url + "/metrics"))
            except OSError:
                out[w.name] = None
        return out

    def flush(self) -> list[str]:
        """Drop every worker's prefix cache (given engines, between runs); the workers that
        refused (vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1) are returned."""
        path = "/flush_cache" if self.spec.engine == "sglang" else "/reset_prefix_cache"
        refused = []
        for w in self.workers:
            try:
                _post(w.url + path)
            except OSError as exc:
                refused.append(f"{w.url}{path}: {exc}")
        return refused

    def cpu_seconds(self) -> float:
        return sum(procs.tree_cpu_seconds(w.proc.pid) for w in self.workers if w.proc is not None)


def start_cluster(group: procs.ProcessGroup, spec: ClusterSpec, log_dir: Path) -> Cluster:
    """Fresh emulated workers (or the given ones, flushed)."""
    spec.check()
    if spec.given:
        workers = [Worker(f"worker{i}", "both", u) for i, u in enumerate(spec.worker_urls)]
        workers += [
            Worker(f"prefill{i}", "prefill", p.url, p.bootstrap_port) for i, p in enumerate(spec.prefill_urls)
        ]
        workers += [Worker(f"decode{i}", "decode", u) for i, u in enumerate(spec.decode_urls)]
        cluster = Cluster(spec, workers)
        for why in cluster.flush():
            print(f"warning: prefix cache not flushed, the run starts warm: {why}", file=sys.stderr)
        return cluster
    extra = ["--profile", spec.profile, "--max-model-len", str(spec.max_model_len)]
    if spec.max_total_tokens is not None:
        extra += ["--max-total-tokens", str(spec.max_total_tokens)]
    extra += spec.emulator_args
    plan = [("both", f"worker{i}") for i in range(spec.colocated)]
    plan += [("prefill", f"prefill{i}") for i in range(spec.prefill)]
    plan += [("decode", f"decode{i}") for i in range(spec.decode)]
    taken: set[int] = set()
    kv: dict[str, str] = {}

    def start(role: str, name: str) -> procs.Upstream:
        if spec.kv_events:
            kv[name] = f"tcp://{procs.HOST}:{free_port_pair(taken)}"
        return procs.start_emulator(
            group,
            spec.engine,
            role,
            model=spec.model,
            time_scale=spec.time_scale,
            # one seed for all: the same "weights", so a decode continues its prefill's
            # tokens (the gateway's guards check that) as real engines of one model do
            seed=0,
            log_dir=log_dir,
            extra=[*extra, "--kv-events", kv[name]] if name in kv else extra,
            wait=False,
        )

    ups = [(role, name, start(role, name)) for role, name in plan]
    workers = []
    for role, name, up in ups:
        for attempt in range(PORT_RACE_TRIES):
            try:
                procs.wait_upstream(up, timeout=90.0)
                break
            except procs.ProcessDied:
                # a port picked for it was taken before it bound it (another process's
                # connection got it): not the target's failure, so start it on new ports
                if attempt == PORT_RACE_TRIES - 1 or not up.proc.lost_port_race():
                    raise
                up = start(role, name)
        workers.append(Worker(name, up.role, up.url, up.bootstrap_port, up.proc, kv.get(name)))
    return Cluster(spec, workers)


# times an emulated worker is started on fresh ports when another process took one of its
# ports between `procs.free_ports` and its bind (one start of 128 in an eight-repeat replay)
PORT_RACE_TRIES = 3


def free_port_pair(taken: set[int]) -> int:
    """A port p with p and p + 1 free and not in `taken` (an emulator's KV-event replay socket
    is on p + 1); both are added to `taken`."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((procs.HOST, 0))
            p: int = s.getsockname()[1]
        if {p, p + 1} & taken:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind((procs.HOST, p))
                b.bind((procs.HOST, p + 1))
            taken |= {p, p + 1}
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")
