"""Config checks: worker URLs with a path are refused (not silently cut), the removed
`timeouts.probe_s` is named with its replacement, a bad `--request-timeout-s` is named after the
flag, and the check for models a worker set can never serve."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.workers import Engine, Role
from gateway.cli_args import parse_serve_args
from gateway.config import ConfigError, WorkerConfig, load_config
from gateway.health import unservable_models
from gateway.registry import Worker


@pytest.mark.parametrize(
    ("url", "needle"),
    [
        ("http://127.0.0.1:8000/v1", "without a path (/v1)"),
        ("http://127.0.0.1:8000/v1/", "without a path (/v1/)"),
        ("https://h.example/api", "without a path (/api)"),
        ("http://127.0.0.1:8000?x=1", "without a query"),
        ("http://127.0.0.1:8000/#top", "without a fragment"),
        ("http://user:pw@127.0.0.1:8000", "without user info"),
        ("http://[::1", "Invalid IPv6 URL"),
    ],
)
def test_worker_url_with_more_than_host_and_port_is_refused(url: str, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        WorkerConfig(url=url, role=Role.COLOCATED)
    assert needle in str(e.value) and repr(url) in str(e.value)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "https://h.example"])
def test_worker_url_host_and_port_still_accepted(url: str) -> None:
    assert WorkerConfig(url=url, role=Role.COLOCATED).url == url


def test_worker_url_with_a_path_is_refused_in_files_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('[[workers]]\nurl = "http://127.0.0.1:9/v1"\nrole = "colocated"\n')
    with pytest.raises(ConfigError, match=r"without a path \(/v1\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"without a path \(/v1\)"):
        parse_serve_args(["--worker", "http://127.0.0.1:9/v1"])


def test_removed_probe_s_is_named_with_its_replacement(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text("[timeouts]\nprobe_s = 0.2\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    text = str(e.value)
    assert "unknown field `probe_s` at `$.timeouts`" in text and "health.timeout_s" in text


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_bad_request_timeout_flag_is_named_after_the_flag(value: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_serve_args(["--worker", "http://127.0.0.1:9", "--request-timeout-s", value])
    text = str(e.value)
    assert text.startswith("--request-timeout-s must be a positive number"), text
    assert "connect_s" not in text


def test_good_request_timeout_flag_still_lowers_the_phase_limits() -> None:
    cfg = parse_serve_args(["--worker", "http://127.0.0.1:9", "--request-timeout-s", "1.5"])
    assert cfg.timeouts.total_s == 1.5 and cfg.timeouts.connect_s == 1.5
    assert math.isclose(cfg.timeouts.prefill_s, 1.5)


# -- models a worker set can never serve -----------------------------------------------------


def _w(wid: str, role: Role, engine: Engine, model: str | None = "m") -> Worker:
    return Worker(wid, "http://127.0.0.1:9", role, engine, model=model)


def test_servable_sets_are_not_reported() -> None:
    P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
    SG, VL = Engine.SGLANG, Engine.VLLM
    assert unservable_models([]) == {}
    assert unservable_models([_w("p", P, SG), _w("d", D, SG)]) == {}
    assert unservable_models([_w("d", D, SG), _w("c", C, Engine.OPENAI)]) == {}
    assert unservable_models([_w("d", D, VL)]) == {}  # a vLLM decode prefills itself
    # a prefill whose model is not known yet may be this model's
    assert unservable_models([_w("p", P, SG, None), _w("d", D, SG)]) == {}


def test_unservable_sets_name_the_model_and_what_is_missing() -> None:
    P, D = Role.PREFILL, Role.DECODE
    SG, VL = Engine.SGLANG, Engine.VLLM
    out = unservable_models([_w("d", D, SG)])
    assert list(out) == ["m"]
    assert out["m"] == "a sglang prefill worker for the decode worker(s) ['d'], or a colocated worker"
    # another engine's prefill does not pair, another model's prefill is not this model's
    out = unservable_models(
        [_w("d", D, SG), _w("p", P, VL), _w("p2", P, SG, "other"), _w("d2", D, SG, "other")]
    )
    assert set(out) == {"m"}
    assert "a sglang prefill worker for the decode worker(s) ['d']" in out["m"]
    assert "a vllm decode worker for the prefill worker(s) ['p']" in out["m"]
    assert unservable_models([_w("p", P, SG)]) == {
        "m": "a sglang decode worker for the prefill worker(s) ['p'], or a colocated worker"
    }
    # no model known at all: the whole set is checked, under None
    out = unservable_models([_w("d1", D, SG, None), _w("d0", D, SG, None)])
    assert out == {
        None: "a sglang prefill worker for the decode worker(s) ['d0', 'd1'], or a colocated worker"
    }
