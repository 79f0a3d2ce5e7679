"""An emulated worker whose port another process took between `procs.free_ports` and its bind is
started again on fresh ports: a replay's cluster start does not fail (and a target's repeat is
not recorded as FAILED) for a race outside the target. Real emulator processes on 127.0.0.1."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from bench import procs
from bench.replay import cluster as cluster_mod
from bench.replay.cluster import ClusterSpec, start_cluster


def taken_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind((procs.HOST, 0))
    s.listen()
    return s, s.getsockname()[1]


def test_a_worker_that_lost_its_port_is_started_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    holder, port = taken_port()
    real = procs.free_ports
    calls: list[list[int]] = []

    def first_taken(n: int, host: str = procs.HOST) -> list[int]:
        got = real(n, host)
        if not calls:  # the first emulator's HTTP port is one another process holds
            got[0] = port
        calls.append(got)
        return got

    monkeypatch.setattr(procs, "free_ports", first_taken)
    spec = ClusterSpec(engine="sglang", colocated=1, time_scale=0.0)
    try:
        with procs.process_group() as group:
            c = start_cluster(group, spec, tmp_path)
            (w,) = c.colocated
            assert w.url != f"http://{procs.HOST}:{port}"
            with urllib.request.urlopen(w.url + "/health", timeout=5) as r:
                assert r.status == 200
            lost = [p for p in group.procs if not p.alive()]
            assert len(lost) == 1 and lost[0].lost_port_race()
    finally:
        holder.close()
    assert len(calls) == 2


def test_a_worker_that_dies_otherwise_is_not_retried(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = ClusterSpec(engine="sglang", colocated=1, emulator_args=["--no-such-flag"])
    starts = 0
    real = procs.start_emulator

    def counted(*a: object, **kw: object) -> procs.Upstream:
        nonlocal starts
        starts += 1
        return real(*a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cluster_mod.procs, "start_emulator", counted)
    with procs.process_group() as group, pytest.raises(procs.ProcessDied):
        start_cluster(group, spec, tmp_path)
    assert starts == 1
