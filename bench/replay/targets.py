"""The front ends a replay compares, each started fresh against a fresh cluster.

A target is written `KIND[:POLICY]` or `LABEL=KIND [ARGS...]`:

  * `direct`: no front end (bench/replay/client.py `Direct`: round robin, the client doing the
    P/D handoff itself);
  * `gateway`: `pd-gateway serve` with ARGS added to its command line, so that any policy,
    decider or TOML file (`--config FILE`) is a target with no change here:
    `gateway:least_load`, `ll-2k=gateway --policy least_load --min-prefill-tokens 2048`,
    `mine=gateway --config my.toml`;
  * `sglang-router`, `vllm-router`: the Rust routers from PyPI, ARGS added likewise
    (`sglang-router:cache_aware`, `vllm-router:power_of_two`,
    `sgl-ca-tight=sglang-router --policy cache_aware --balance-abs-threshold 8`). Colocated
    workers are given as `--worker-urls`; a P/D pool through each router's own P/D mode
    (sglang-router `--pd-disaggregation` for SGLang engines, vllm-router
    `--vllm-pd-disaggregation` for vLLM engines). Neither takes a mixed pool: there a router
    gets the P/D pool only (its always-disaggregate) and the colocated workers stay idle.

With `--kv-events` (the emulators publish their KV events) a gateway gets its workers from a
TOML file written beside the run's logs (`LABEL.kv.toml`): the target's own `--config` file
followed by the workers, each with its `[workers.kv_events]`. Its precise index serves text
prompts only where that file also has a `[tokenizer]` (gateway/routing_tokenizer.py); routers
get the same emulators and leave their events unread.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import procs
from bench.replay.cluster import Cluster

KINDS = ("direct", "gateway", "sglang-router", "vllm-router")


@dataclass(frozen=True)
class TargetSpec:
    label: str
    kind: str
    args: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> TargetSpec:
        text = text.strip()
        label, eq, rest = text.partition("=")
        if eq and label and " " not in label:
            words = shlex.split(rest)
            if not words:
                raise ValueError(f"target {text!r}: no kind after '='")
            kind, args = words[0], tuple(words[1:])
        else:
            kind, _, policy = text.partition(":")
            args = ("--policy", policy) if policy else ()
            label = text
        if kind not in KINDS:
            raise ValueError(f"target {text!r}: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        if kind == "direct" and args:
            raise ValueError(f"target {text!r}: the direct baseline takes no arguments")
        return cls(label, kind, args)

    def check(self, cluster_shape: str, engine: str) -> None:
        """Refuse a router in a shape it cannot serve, before anything starts."""
        if cluster_shape in ("pd", "mixed") and self.kind == "sglang-router" and engine != "sglang":
            raise ValueError(f"{self.label}: sglang-router's P/D mode speaks SGLang's handoff only")
        if cluster_shape in ("pd", "mixed") and self.kind == "vllm-router" and engine != "vllm":
            raise ValueError(f"{self.label}: vllm-router's P/D mode here is vLLM's (NIXL) handoff only")
        if cluster_shape == "mixed" and self.kind == "direct":
            raise ValueError(f"{self.label}: the direct baseline takes colocated workers or a P/D pool")


@dataclass
class RunningTarget:
    spec: TargetSpec
    url: str | None  # None: direct
    proc: procs.ManagedProcess | None = None
    argv: list[str] = field(default_factory=list)

    def cpu_seconds(self) -> float:
        return procs.tree_cpu_seconds(self.proc.pid) if self.proc is not None else 0.0


def target_argv(
    spec: TargetSpec, cluster: Cluster, port: int, prom_port: int, config_dir: Path | None = None
) -> list[str]:
    """The target's command line. With KV events (`--kv-events`), a gateway's workers are written
    to a TOML file in `config_dir` with their `kv_events` tables (`kv_events_config`)."""
    engine = cluster.spec.engine
    if spec.kind == "gateway" and any(w.kv_events for w in cluster.workers):
        path = (config_dir or Path(".")) / f"{spec.label.replace('/', '_')}.kv.toml"
        args = kv_events_config(spec.args, cluster, path)
        argv = [*procs.pd_gateway_argv(), "serve", "--engine", engine]
        argv += ["--host", procs.HOST, "--port", str(port), "--log-level", "warning"]
        return [*argv, *args]
    if spec.kind == "gateway":
        argv = [*procs.pd_gateway_argv(), "serve", "--engine", engine]
        for w in cluster.colocated:
            argv += ["--worker", w.url]
        for w in cluster.prefill:
            argv += ["--prefill", w.url, str(w.bootstrap_port) if w.bootstrap_port else "none"]
        for w in cluster.decode:
            argv += ["--decode", w.url]
        argv += ["--host", procs.HOST, "--port", str(port), "--log-level", "warning"]
        return [*argv, *spec.args]
    mod = "sglang_router" if spec.kind == "sglang-router" else "vllm_router"
    argv = [sys.executable, "-m", f"{mod}.launch_router"]
    if not cluster.prefill:
        argv += ["--worker-urls", *(w.url for w in cluster.colocated)]
    else:
        argv.append("--pd-disaggregation" if spec.kind == "sglang-router" else "--vllm-pd-disaggregation")
        for w in cluster.prefill:
            argv += ["--prefill", w.url]
            if spec.kind == "sglang-router":
                argv.append(str(w.bootstrap_port) if w.bootstrap_port else "none")
        for w in cluster.decode:
            argv += ["--decode", w.url]
    level = "warn" if spec.kind == "sglang-router" else "warning"
    return [*argv, *procs.router_common_argv(procs.HOST, port, prom_port), "--log-level", level, *spec.args]


def kv_events_config(args: Sequence[str], cluster: Cluster, path: Path) -> list[str]:
    """`args` with the target's own `--config FILE` (if any) replaced by `path`: that file's text
    followed by a `[[workers]]` table per worker, each with the `[workers.kv_events]` of its
    emulator (the emulator's hash scheme; the replay socket on the port after the PUB one).
    ConfigError (gateway/config.py) when the result is not a valid configuration."""
    from gateway.config import load_config

    rest: list[str] = []
    text = ""
    it = iter(args)
    for a in it:
        if a == "--config" or a.startswith("--config="):
            own = a.partition("=")[2] or next(it, "")
            text = Path(own).read_text() + "\n"
        else:
            rest.append(a)
    role = {"both": "colocated", "prefill": "prefill", "decode": "decode"}
    for w in cluster.workers:
        text += f'\n[[workers]]\nurl = "{w.url}"\nrole = "{role[w.role]}"\nengine = "{cluster.spec.engine}"\n'
        if w.role == "prefill" and cluster.spec.engine == "sglang" and w.bootstrap_port:
            text += f"bootstrap_port = {w.bootstrap_port}\n"
        if w.kv_events:
            head, _, pub = w.kv_events.rpartition(":")
            text += (
                f'[workers.kv_events]\nendpoint = "{w.kv_events}"\n'
                f'replay_endpoint = "{head}:{int(pub) + 1}"\nhash = "emulator"\n'
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    load_config(path)
    return ["--config", str(path), *rest]


def start_target(
    group: procs.ProcessGroup, spec: TargetSpec, cluster: Cluster, log_dir: Path
) -> RunningTarget:
    spec.check(cluster.spec.shape, cluster.spec.engine)
    if spec.kind == "direct":
        return RunningTarget(spec, None)
    port, prom_port = procs.free_ports(2)
    argv = target_argv(spec, cluster, port, prom_port, log_dir)
    proc = group.add(
        procs.start_process(spec.label.replace("/", "_"), argv, log_dir=log_dir, cwd=procs.REPO_ROOT)
    )
    proc.wait_port(port, timeout=120.0)
    return RunningTarget(spec, f"http://{procs.HOST}:{port}", proc, argv)
