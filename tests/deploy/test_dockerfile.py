"""The Dockerfile without Docker: multi-stage, the runtime stage unprivileged with `pd-gateway` as
its entry point, every path it copies present, and its health check command, run here as the
container would run it, passes against a live gateway and fails against a dead port."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

from emulator.api import EmulatorSpec, spawn_emulator
from tests.deploy.support import ROOT
from tests.integration.test_cli_serve import free_port, run_gateway

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)  # continued lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def test_multi_stage_and_unprivileged() -> None:
    build, runtime = stages()
    assert build[0][1].endswith(" AS build") and "slim" in build[0][1]
    assert "slim" in runtime[0][1]
    assert ("COPY", "--from=build /opt/pd-gateway /opt/pd-gateway") in runtime
    user = next(rest for word, rest in runtime if word == "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0
    assert json.loads(next(rest for word, rest in runtime if word == "ENTRYPOINT")) == ["pd-gateway"]
    assert json.loads(next(rest for word, rest in runtime if word == "CMD"))[0] == "serve"
    # the runtime stage installs nothing: the build stage's venv is all it gets
    assert not [rest for word, rest in runtime if word == "RUN" and "pip" in rest]


def test_copied_sources_exist_and_the_extra_is_declared() -> None:
    build = stages()[0]
    for word, rest in build:
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert (ROOT / src).exists(), src
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "kubernetes" in extras
    assert "emulator" in extras  # `pd-gateway emulate` runs from the same image
    pip = next(rest for word, rest in build if word == "RUN" and "pip install" in rest)
    assert "'.[kubernetes,emulator]'" in pip
    # every package the image's console script may import is copied (bench stays out: not shipped)
    copied = {src for word, rest in build if word == "COPY" for src in rest.split()[:-1]}
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = {p.rstrip("*") for p in find["include"]} - {"bench"}
    assert packages <= copied, packages - copied
    # uvloop, the event loop `pd-gateway serve` installs, is a dependency on Linux
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("uvloop") for d in deps)


def _healthcheck() -> list[str]:
    runtime = stages()[1]
    rest = next(rest for word, rest in runtime if word == "HEALTHCHECK")
    cmd = json.loads(rest[rest.index("CMD") + 3 :].strip())
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


def test_the_healthcheck_passes_on_a_live_gateway_and_fails_on_a_dead_one() -> None:
    cmd = _healthcheck()
    emu = spawn_emulator(EmulatorSpec(engine="vllm", role="both", model="m"))
    try:
        proc, url = run_gateway(["--worker", emu.url, "--engine", "vllm"])
        try:
            env = os.environ | {"PD_GATEWAY_HEALTH_URL": url + "/health"}
            assert subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode == 0
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        emu.terminate()
    env = os.environ | {"PD_GATEWAY_HEALTH_URL": f"http://127.0.0.1:{free_port()}/health"}
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=30).returncode != 0
    default = next(rest for word, rest in stages()[1] if word == "ENV")
    assert "PD_GATEWAY_HEALTH_URL=http://127.0.0.1:8000/health" in default


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for path in (".git", ".venv*", "tests", "bench"):
        assert path in ignored
    for word, rest in stages()[0]:  # nothing the build copies is ignored
        if word == "COPY" and not rest.startswith("--from"):
            assert not set(rest.split()[:-1]) & set(ignored)
