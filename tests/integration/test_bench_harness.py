"""The benchmark harness: its CPU pinning, its wrk driver, its rounds.

`pd-gateway bench overhead` pins itself (and so the upstreams and the load generator) to the
upstream CPU before it starts the target under test on the other one. The target must land on
its own CPU even though its parent's affinity no longer includes it: for a whole day the tables
were measured with every process on CPU 1 because the child inherited the parent's mask.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from bench import overhead, procs
from bench.wrk import _lua_string

TWO_CPUS = hasattr(os, "sched_getaffinity") and {0, 1} <= os.sched_getaffinity(0)


@pytest.mark.skipif(
    not TWO_CPUS or procs.pin_argv(["x"], "0") == ["x"], reason="needs CPUs 0 and 1 and taskset"
)
def test_a_target_is_pinned_to_its_cpu_after_the_parent_pinned_itself_elsewhere(tmp_path: object) -> None:
    script = textwrap.dedent(
        """
        import os
        from bench import procs
        os.sched_setaffinity(0, {1})  # as bench overhead's main does for itself
        p = procs.start_process("pin-check", ["sleep", "30"], cpus="0")
        try:
            import time
            for _ in range(100):
                try:
                    with open(f"/proc/{p.pid}/comm") as f:
                        if f.read().strip() == "sleep":
                            break
                except OSError:
                    pass
                time.sleep(0.02)
            print(sorted(os.sched_getaffinity(p.pid)))
        finally:
            p.stop(5.0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=procs.REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "[0]", out.stdout + out.stderr


def test_wrk_body_is_a_lua_literal_of_the_exact_bytes() -> None:
    body = b'{"prompt":"a \\"q\\" \\\\ caf\xc3\xa9\\n"}'
    lit = _lua_string(body)
    assert lit.startswith('"') and lit.endswith('"')
    # Decode the literal the way Lua does (decimal escapes) and compare bytes.
    inner, out, i = lit[1:-1], bytearray(), 0
    while i < len(inner):
        if inner[i] == "\\":
            out.append(int(inner[i + 1 : i + 4]))
            i += 4
        else:
            out.append(ord(inner[i]))
            i += 1
    assert bytes(out) == body


def test_rounds_are_reported_as_each_figures_median() -> None:
    from bench.overhead import Row, median_row

    def row(rps: float, cpu: float | None, sys_us: float, errors: int) -> Row:
        return Row(
            target="gateway",
            engine="sglang",
            mode="nonstream",
            conns=64,
            rps=rps,
            p50_ms=rps / 100,
            p90_ms=1.0,
            p99_ms=2.0,
            completed=100,
            errors=errors,
            cpu_us_per_req=cpu,
            upstream_cpu_us_per_req=10.0,
            sys_us_per_req=sys_us,
        )

    m = median_row([row(1000, 300.0, 50, 0), row(3000, 100.0, 70, 1), row(2000, None, 60, 0)])
    assert (m.rps, m.p50_ms, m.sys_us_per_req) == (2000, 20.0, 60)
    assert m.cpu_us_per_req == 200.0  # the median of the rounds that have a figure
    assert (m.completed, m.errors, m.rounds) == (300, 1, 3)
    one = row(1, 2.0, 3, 0)
    assert median_row([one]) is one


def test_as_shipped_leaves_each_targets_own_policy_and_log_level() -> None:
    """`--as-shipped`: the routers and the gateway get no --policy/--log-level (their defaults)."""
    pre = [("http://127.0.0.1:1", 8998)]
    dec = ["http://127.0.0.1:2"]
    quiet = procs.sglang_router_argv(10, pre, dec, prometheus_port=11)
    shipped = procs.sglang_router_argv(10, pre, dec, prometheus_port=11, policy=None, log_level=None)
    assert quiet[quiet.index("--policy") + 1] == "round_robin" and "--log-level" in quiet
    assert "--policy" not in shipped and "--log-level" not in shipped
    vquiet = procs.vllm_router_argv(10, ["http://127.0.0.1:1"], dec, prometheus_port=11)
    vshipped = procs.vllm_router_argv(
        10, ["http://127.0.0.1:1"], dec, prometheus_port=11, policy=None, log_level=None
    )
    assert "--policy" in vquiet and "--policy" not in vshipped and "--log-level" not in vshipped
    assert "--log-level" in procs.gateway_argv("sglang", 10, pre, dec)
    assert "--log-level" not in procs.gateway_argv("sglang", 10, pre, dec, log_level=None)
    assert overhead.parse_args(["--as-shipped"]).as_shipped and not overhead.parse_args([]).as_shipped


def test_the_default_run_has_every_target_at_info_and_round_robin() -> None:
    """Issue #33 asks for the gateway's full feature set, logs at info: that is the default run
    (the routers at their default level too, all round robin); `--quiet-logs` is the old run."""
    for kind in ("gateway", "gateway-x2", "gateway-noguards"):
        assert overhead.target_settings(kind, "info") == (None, None)
        assert overhead.target_settings(kind, "quiet") == (None, "warning")
    assert overhead.target_settings("sglang-router", "info") == ("round_robin", None)
    assert overhead.target_settings("vllm-router", "info") == ("round_robin", None)
    assert overhead.target_settings("sglang-router", "quiet") == ("round_robin", "warn")
    assert overhead.target_settings("vllm-router", "as-shipped") == (None, None)
    assert overhead._settings(overhead.parse_args([])) == "info"
    assert overhead._settings(overhead.parse_args(["--quiet-logs"])) == "quiet"
    with pytest.raises(SystemExit):
        overhead.parse_args(["--quiet-logs", "--as-shipped"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-process CPU clocks")
def test_a_target_s_cpu_time_is_read_to_well_under_a_clock_tick() -> None:
    """`bench overhead` reads a target's CPU from each process's CPU-time clock: a stream row's
    few hundred ms of CPU over three processes was rounded to 10 ms ticks per process before.
    A child that burns CPU and reports its own `process_time()` is read within 2 ms of it."""
    script = (
        "import sys, time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.123: pass\n"
        "print(time.process_time(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        own = float(child.stdout.readline())
        seen = procs.tree_runtime_seconds(child.pid)
        assert own <= seen < own + 0.002
    finally:
        child.kill()
        child.wait()


@pytest.mark.skipif(not TWO_CPUS, reason="needs CPUs 0 and 1")
def test_x2_cpus_pins_each_serving_process_to_its_own_cpu() -> None:
    """`--x2-cpus 0,1`: `serve --workers 2`'s two serving processes, every thread of each, one
    to a CPU; the supervisor stays where it was (a parent with two children and a thread each
    stands in for it)."""
    script = (
        "import os, sys, threading\n"
        "os.sched_setaffinity(0, {0, 1})\n"
        "for _ in range(2):\n"
        "    if os.fork() == 0:\n"
        "        threading.Thread(target=sys.stdin.read, daemon=True).start()\n"
        "        os.write(1, b'up\\n')  # one write: the two children's never interleave\n"
        "        sys.stdin.read()\n"
        "        os._exit(0)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        assert [parent.stdout.readline(), parent.stdout.readline()] == ["up\n", "up\n"]
        pinned = procs.pin_children(parent.pid, [0, 1])
        assert [cpu for _, cpu in pinned] == [0, 1]
        for child, cpu in pinned:
            tids = os.listdir(f"/proc/{child}/task")
            assert len(tids) == 2
            assert all(os.sched_getaffinity(int(t)) == {cpu} for t in tids)
        assert os.sched_getaffinity(parent.pid) == {0, 1}
        with pytest.raises(ValueError):
            procs.pin_children(parent.pid, [0])
    finally:
        assert parent.stdin is not None
        parent.stdin.close()  # every process reads it: all three end
        parent.wait(5)


def test_a_neighbour_is_spin_or_copy_of_some_megabytes() -> None:
    """`bench overhead --neighbour`: the control process beside a target (bench/neighbour.py);
    a kind it cannot run is refused before anything starts."""
    from bench import neighbour

    assert neighbour.parse("spin") == 0 and neighbour.parse("copy:8") == 8
    for bad in ("copy", "copy:1", "copy:x", "walk:8"):
        with pytest.raises(ValueError):
            neighbour.parse(bad)
    assert overhead.main(["--neighbour", "walk:8"]) == 2
