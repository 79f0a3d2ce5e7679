"""docker-compose.yml without Docker: it validates against the Compose Specification's JSON schema
(vendored, tests/fixtures/vendor/), each profile is a whole stack, every engine command uses
flags that exist in the engine version its image tag names, every mounted gateway config passes
the gateway's own validation and points at the stack's engines, and no secret is written in."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from emulator.cli import build_parser as emulator_parser
from gateway.cli_args import parse_serve_command
from gateway.config import GatewayConfig, load_config
from policies.snapshot import Engine, Role
from tests.deploy.support import ROOT, check_engine_args, image_version, interpolate, load_compose

SCHEMA = ROOT / "tests" / "fixtures" / "vendor" / "compose-spec.json"
PROFILES = ("emulator", "sglang-gpu", "vllm-gpu")
SGLANG_IMAGE, VLLM_IMAGE = "lmsysorg/sglang", "vllm/vllm-openai"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def services(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose["services"].items() if profile in s.get("profiles", [])}


def test_validates_against_the_compose_specification(compose: dict[str, Any]) -> None:
    # the schema names draft-07 (as "https://json-schema.org/draft-07/schema", without the "#")
    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    validator.validate(compose)
    # and it is strict enough to catch a misspelt key
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["helthcheck"] = broken["services"]["gateway"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError, match="helthcheck"):
        validator.validate(broken)


def test_interpolation_reads_environment_variables() -> None:
    doc = load_compose({"PDGW_PORT": "9000", "MODEL": "my/model", "PDGW_LOG_LEVEL": "debug"})
    assert doc["services"]["gateway"]["ports"] == ["9000:8000"]
    assert doc["services"]["gateway"]["command"][-1] == "debug"
    assert doc["services"]["sglang-prefill"]["command"][1] == "my/model"
    assert interpolate("a $$b ${X:-c} ${Y-d} ${Z}", {"Y": ""}) == "a $b c  "


def test_every_service_belongs_to_one_stack_and_the_default_is_the_emulator(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        assert set(svc.get("profiles", [])) <= set(PROFILES) and svc.get("profiles"), name
    env = dict(
        line.split("=", 1)
        for line in (ROOT / ".env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert env["COMPOSE_PROFILES"] == "emulator"


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_is_a_whole_stack(compose: dict[str, Any], profile: str) -> None:
    svcs = services(compose, profile)
    images = [s.get("image", "") for s in svcs.values()]
    assert sum(1 for i in images if i.startswith("prom/prometheus:")) == 1
    assert sum(1 for i in images if i.startswith("grafana/grafana:")) == 1
    gateways = [n for n, s in svcs.items() if s.get("command", [None])[0] == "serve"]
    assert len(gateways) == 1, gateways
    for name, svc in svcs.items():
        assert "healthcheck" in svc, f"{name} has no health check"
        for dep, cond in svc.get("depends_on", {}).items():
            assert dep in svcs and cond == {"condition": "service_healthy"}, (name, dep)


def _mounted_config(svc: dict[str, Any]) -> Path:
    for vol in svc["volumes"]:
        src, dst, *_ = vol.split(":")
        if dst == "/etc/pd-gateway/gateway.toml":
            return ROOT / src
    raise AssertionError("no gateway config mounted")


def _gateway(compose: dict[str, Any], profile: str) -> tuple[dict[str, Any], GatewayConfig]:
    svc = next(s for s in services(compose, profile).values() if s.get("command", [None])[0] == "serve")
    path = _mounted_config(svc)
    cfg = load_config(path)
    # the container's command line as `pd-gateway serve` reads it, with the mounted file
    argv = [str(path) if a == "/etc/pd-gateway/gateway.toml" else a for a in svc["command"][1:]]
    cfg2, notes = parse_serve_command(argv)
    assert cfg2.workers == cfg.workers and notes == []
    return svc, cfg


def test_emulator_stack_is_an_sglang_pd_cluster_behind_the_gateway(compose: dict[str, Any]) -> None:
    svcs = services(compose, "emulator")
    svc, cfg = _gateway(compose, "emulator")
    assert (cfg.listen.host, cfg.listen.port) == ("0.0.0.0", 8000) and svc["ports"] == ["8000:8000"]
    roles = sorted(w.role.value for w in cfg.workers)
    assert roles == ["colocated", "decode", "decode", "prefill", "prefill"]
    parser = emulator_parser()
    for w in cfg.workers:
        host, port = w.url.removeprefix("http://").split(":")
        engine = svcs[host]  # the worker is a service of the same stack ...
        assert engine["command"][0] == "emulate" and engine["image"] == svc["image"]
        args = parser.parse_args(engine["command"][1:])  # ... whose command the emulator accepts
        assert (args.engine, int(args.port), args.host) == (w.engine.value, int(port), "0.0.0.0")
        assert {"prefill": "prefill", "decode": "decode", "both": "colocated"}[args.role] == w.role.value
        if w.role is Role.PREFILL:
            assert w.bootstrap_port == args.bootstrap_port
        health = " ".join(engine["healthcheck"]["test"])
        assert f"127.0.0.1:{port}/health" in health
        assert svc["depends_on"][host] == {"condition": "service_healthy"}


@pytest.mark.parametrize(
    ("profile", "engine", "image"),
    [("sglang-gpu", Engine.SGLANG, SGLANG_IMAGE), ("vllm-gpu", Engine.VLLM, VLLM_IMAGE)],
)
def test_gpu_stacks(compose: dict[str, Any], profile: str, engine: Engine, image: str) -> None:
    svcs = services(compose, profile)
    _, cfg = _gateway(compose, profile)
    engines = {n: s for n, s in svcs.items() if s.get("image", "").startswith(image + ":")}
    assert len(engines) == 2
    ports: dict[int, str] = {}
    gpus: list[str] = []
    for name, svc in engines.items():
        version = image_version(svc["image"], image)
        args = svc["command"]
        check_engine_args(engine.value, version, args)
        ports[int(args[args.index("--port") + 1])] = name
        assert svc["network_mode"] == "host"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        gpus += device["device_ids"]
        assert "model-cache:/root/.cache/huggingface" in svc["volumes"]
        port = args[args.index("--port") + 1]
        assert f"127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])
        if engine is Engine.SGLANG:
            assert svc["entrypoint"] == ["python3", "-m", "sglang.launch_server"]
            mode = args[args.index("--disaggregation-mode") + 1]
            assert args[args.index("--disaggregation-transfer-backend") + 1] == "mooncake"
            assert "--enable-metrics" in args
            if mode == "prefill":
                assert "--disaggregation-bootstrap-port" in args
        else:
            assert svc["entrypoint"] == ["vllm", "serve"]
            kv = json.loads(args[args.index("--kv-transfer-config") + 1])
            assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
            assert svc["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert len(set(gpus)) == 2  # one GPU each
    if engine is Engine.VLLM:  # each server its own NIXL side channel on the shared host network
        assert len({s["environment"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] for s in engines.values()}) == 2
    # the gateway's workers are these servers, in their roles
    for w in cfg.workers:
        port = int(w.url.rsplit(":", 1)[1])
        svc = engines[ports[port]]
        assert w.engine is engine
        if engine is Engine.SGLANG:
            args = svc["command"]
            assert args[args.index("--disaggregation-mode") + 1] == w.role.value
            if w.role is Role.PREFILL:
                assert w.bootstrap_port == int(args[args.index("--disaggregation-bootstrap-port") + 1])


def test_engine_flag_check_catches_a_wrong_flag_or_choice() -> None:
    with pytest.raises(AssertionError, match="has no flag --disaggregation-bootstrap"):
        check_engine_args("sglang", "0.5.23", ["--disaggregation-bootstrap", "8998"])
    with pytest.raises(AssertionError, match="'nixl2' not in"):
        check_engine_args("sglang", "0.5.23", ["--disaggregation-transfer-backend", "nixl2"])
    with pytest.raises(AssertionError, match="has no flag --kv-transfer-cfg"):
        check_engine_args("vllm", "0.32.0", ["--kv-transfer-cfg", "{}"])
    with pytest.raises(FileNotFoundError):  # an image tag whose flags were not vendored
        check_engine_args("vllm", "0.99.0", ["--port", "1"])


def test_no_secret_is_written_in(compose: dict[str, Any]) -> None:
    raw = (ROOT / "docker-compose.yml").read_text()
    for word in ("TOKEN=", "PASSWORD=", "API_KEY="):
        assert word not in raw
    for name, svc in compose["services"].items():
        env = svc.get("environment", {})
        for key in env:
            assert not any(s in key for s in ("TOKEN", "PASSWORD", "SECRET", "API_KEY")), (name, key)
        for entry in svc.get("env_file", []):
            path = ROOT / entry["path"]
            assert entry["required"] is False, (name, "the stack starts without secrets")
            assert (path.parent / (path.name + ".example")).exists(), path
            ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT)
            assert ignored.returncode == 0, f"{path} is not ignored by git"
    assert "PDGW_ADMIN_TOKEN" in (ROOT / "deploy/compose/gateway.env.example").read_text()


@pytest.mark.parametrize("profile", PROFILES)
def test_the_admin_token_comes_from_the_environment(compose: dict[str, Any], profile: str) -> None:
    svc, cfg = _gateway(compose, profile)
    assert cfg.admin.token is None and cfg.admin.token_env == "PDGW_ADMIN_TOKEN"
    assert cfg.admin.resolve_token({}) is None  # unset: admin off, the stack still starts
    assert cfg.admin.resolve_token({"PDGW_ADMIN_TOKEN": "t"}) == "t"
    assert svc["env_file"] == [{"path": "deploy/compose/gateway.env", "required": False}]


def test_every_mounted_file_exists(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: {src}"
            else:
                assert src in compose["volumes"], f"{name}: volume {src}"
