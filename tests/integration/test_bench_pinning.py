"""The benchmark's CPU pinning and its wrk driver.

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

from bench import procs
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
