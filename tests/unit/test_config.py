"""Gateway config: strict TOML decoding, validation, flags, merge rules, the shipped example."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from common.workers import Engine, Role
from gateway.cli_args import parse_serve_args
from gateway.config import (
    AdminConfig,
    ConfigError,
    GatewayConfig,
    WorkerConfig,
    config_from_raw,
    load_config,
    to_toml,
)
from policies.build import build_policy
from policies.config import LeastLoadCfg, PluginCfg, PowerOfTwoCfg, RandomCfg, RoundRobinCfg

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gateway.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gw.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    c = GatewayConfig()
    assert (c.listen.host, c.listen.port) == ("127.0.0.1", 8000)
    assert c.policy == RoundRobinCfg() and c.effective_decode_policy == RoundRobinCfg()
    assert c.timeouts.total_s == 600 and c.retries.max_attempts == 3 and c.breaker.open_s == 30
    assert c.timeouts.client_stall_s == 60
    assert c.limits.max_body_bytes == 16 * 1024 * 1024 and c.limits.max_header_bytes == 64 * 1024
    assert c.fallback.ladder == ("other_pair", "colocated", "decode_self_prefill", "shed")
    assert c.request_id_headers == ("x-request-id", "x-correlation-id")
    assert not c.admin.enabled and not c.forward_authorization


def test_example_file_loads_and_builds() -> None:
    c = load_config(EXAMPLE)
    assert len(c.workers) == 5
    assert c.workers[0].bootstrap_port == 8998 and c.workers[0].worker_id == "sgl-prefill-0"
    assert c.workers[4].engine is Engine.OPENAI and c.workers[4].worker_id == "hosted"
    assert c.workers[2].worker_id == "http://10.0.1.1:8100"
    assert c.prefill_policy == LeastLoadCfg() and c.decode_policy == PowerOfTwoCfg(seed=7)
    assert c.admin.resolve_token({"PD_GATEWAY_ADMIN_TOKEN": "s3cret"}) == "s3cret"
    build_policy(c.policy, prefill=c.prefill_policy, decode=c.decode_policy, decider=c.decider)


async def test_example_file_builds_a_gateway() -> None:
    """Every worker of the example (an https one among them) becomes a Worker; nothing is started."""
    from gateway.app import Gateway

    env = {"HOSTED_API_KEY": "k", "PD_GATEWAY_ADMIN_TOKEN": "t"}
    g = Gateway(load_config(EXAMPLE), environ=env)
    urls = sorted(w.url for w in g.registry.workers())
    assert len(urls) == 5 and urls[-1] == "https://api.internal.example:443", urls
    assert g.registry.find("hosted").pool.tls is not None  # type: ignore[union-attr]


def test_docs_embed_the_example() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S)
    assert block is not None and block.group(1) == EXAMPLE.read_text()


@pytest.mark.parametrize(
    "cfg",
    [
        GatewayConfig(),
        load_config(EXAMPLE),
        GatewayConfig(
            policy=PluginCfg(name="x", options={"a": 1, "nested": {"b": [1, 2]}, "s": 'q"uote'}),
            workers=(WorkerConfig(url="http://a:1", role=Role.COLOCATED, labels={"weird key": "v"}),),
            log_level="debug",
        ),
    ],
)
def test_toml_round_trip(cfg: GatewayConfig, tmp_path: Path) -> None:
    assert load_config(write(tmp_path, to_toml(cfg))) == cfg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[tiemouts]\ntotal_s = 1\n", "unknown field `tiemouts` at `$`"),
        ("[timeouts]\nconect_s = 1\n", "unknown field `conect_s` at `$.timeouts`"),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\nmodle = "m"\n',
            "unknown field `modle` at `$.workers[0]`",
        ),
        (
            'policy = { type = "least_load", waiting_weigth = 1 }\n',
            "unknown field `waiting_weigth` at `$.policy`",
        ),
        ('policy = "roundrobin"\n', "Invalid value 'roundrobin' - at `$.policy.type`"),
        ('[listen]\nport = "80"\n', "Expected `int`, got `str` - at `$.listen.port`"),
        ("[listen]\nport = 70000\n", "listen.port must be in 0..65535"),
        ("[timeouts]\nprefill_s = 900\n", "timeouts.prefill_s (900.0) must be <= timeouts.total_s"),
        ("[timeouts]\nconnect_s = 0\n", "timeouts.connect_s must be a positive number"),
        ("[timeouts]\nclient_stall_s = 0\n", "timeouts.client_stall_s must be a positive number"),
        (
            "[timeouts]\nclient_stall_s = 700\n",
            "timeouts.client_stall_s (700.0) must be <= timeouts.total_s",
        ),
        ("[retries]\nmax_attempts = 0\n", "retries.max_attempts must be >= 1"),
        ("[guards]\nshadow_fraction = 1.5\n", "guards.shadow_fraction must be in"),
        ('[fallback]\nladder = ["shed", "colocated"]\n', "'shed' must be the last rung"),
        ('[fallback]\nladder = ["colocated", "colocated"]\n', "duplicates"),
        ('[fallback]\nladder = ["elsewhere"]\n', "Invalid enum value 'elsewhere'"),
        ('[admin]\ntoken = "a"\ntoken_env = "B"\n', "set token_env or token, not both"),
        ('request_id_headers = ["X Id"]\n', "must be a lowercase header name"),
        (
            '[limits]\nclient_key_header = "x api key"\n',
            "limits.client_key_header: 'x api key' is not a header",
        ),
        ('log_level = "loud"\n', "Invalid enum value 'loud' - at `$.log_level`"),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\nbootstrap_port = 8998\n',
            "bootstrap_port applies only to sglang prefill workers",
        ),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "prefill"\nengine = "vllm"\nbootstrap_port = 1\n',
            "bootstrap_port applies only to sglang prefill",
        ),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\nengine = "openai"\n',
            "openai can only be colocated",
        ),
        ('[[workers]]\nurl = "a:1"\nrole = "decode"\n', "must be http(s)://host[:port]"),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decoder"\n',
            "Invalid enum value 'decoder' - at `$.workers[0].role`",
        ),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\nweight = 0\n',
            "worker.weight must be a positive",
        ),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\n[[workers]]\nurl = "http://a:1/"\nrole = "prefill"\nid = "x"\n',
            "duplicate worker url",
        ),
        (  # one server however its URL is spelled: scheme and host case, the default port
            '[[workers]]\nurl = "HTTP://A:80"\nrole = "decode"\n[[workers]]\nurl = "http://a"\nrole = "prefill"\n',
            "duplicate worker url 'http://a' (as http://a:80)",
        ),
        (
            '[[workers]]\nurl = "http://a:1"\nrole = "decode"\nid = "x"\n[[workers]]\nurl = "http://b:1"\nrole = "decode"\nname = "x"\n',
            "duplicate worker id 'x'",
        ),
        ("listen = [", "invalid TOML"),
    ],
)
def test_errors_name_the_key(text: str, message: str, tmp_path: Path) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config("/nonexistent/gw.toml")


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ('policy = "least_load"', LeastLoadCfg()),
        ('policy = "plugin:mine"', PluginCfg(name="mine")),
        ('policy = { type = "random", seed = 4 }', RandomCfg(seed=4)),
        (
            '[policy]\ntype = "plugin"\nname = "p"\noptions = { k = [1, 2] }',
            PluginCfg(name="p", options={"k": [1, 2]}),
        ),
    ],
)
def test_policy_forms(text: str, expect: object) -> None:
    assert config_from_raw(tomllib.loads(text)).policy == expect


def test_worker_api_key_resolution() -> None:
    w = WorkerConfig(url="http://a:1", role=Role.COLOCATED, engine=Engine.OPENAI, api_key_env="K")
    assert w.api_key({"K": "v"}) == "v"
    with pytest.raises(ConfigError, match="K is not set"):
        w.api_key({})
    assert AdminConfig().resolve_token({}) is None


# ---- flags -------------------------------------------------------------------------------------


def test_flags_sglang_router_style() -> None:
    c = parse_serve_args(
        [
            "--prefill",
            "http://h:1",
            "8998",
            "--prefill",
            "http://h:2",
            "none",
            "--prefill",
            "http://h:3",
            "--decode",
            "http://h:4",
            "--worker",
            "http://h:5",
            "--model",
            "m",
        ]
    )
    assert [(w.url, w.role, w.engine, w.bootstrap_port, w.model) for w in c.workers] == [
        ("http://h:1", Role.PREFILL, Engine.SGLANG, 8998, "m"),
        ("http://h:2", Role.PREFILL, Engine.SGLANG, None, "m"),
        ("http://h:3", Role.PREFILL, Engine.SGLANG, 8998, "m"),
        ("http://h:4", Role.DECODE, Engine.SGLANG, None, "m"),
        ("http://h:5", Role.COLOCATED, Engine.SGLANG, None, "m"),
    ]


def test_flags_vocab_size_applies_to_the_flag_workers() -> None:
    c = parse_serve_args(["--prefill", "http://h:1", "--decode", "http://h:2", "--vocab-size", "32000"])
    assert [w.vocab_size for w in c.workers] == [32000, 32000]
    assert parse_serve_args(["--decode", "http://h:2"]).workers[0].vocab_size is None
    with pytest.raises(ConfigError, match="vocab_size must be at least 1"):
        parse_serve_args(["--decode", "http://h:2", "--vocab-size", "0"])


def test_flags_vllm_prefill_has_no_bootstrap_port() -> None:
    c = parse_serve_args(["--engine", "vllm", "--prefill", "http://h:1", "--decode", "http://h:2"])
    assert [(w.engine, w.bootstrap_port) for w in c.workers] == [(Engine.VLLM, None), (Engine.VLLM, None)]
    with pytest.raises(ConfigError, match="bootstrap_port applies only to sglang prefill"):
        parse_serve_args(["--engine", "vllm", "--prefill", "http://h:1", "9000"])


def test_no_guards_holds_nothing_for_the_prefill_verdict() -> None:
    """`--no-guards`: the checks off, and an SGLang stream's tokens flow before the prefill's
    verdict (checked before the end); the default holds them until it is in."""
    off = parse_serve_args(["--decode", "http://h:2", "--no-guards"]).guards
    assert (off.length_preflight, off.decode_consistency, off.prefill_verdict) == (False, False, "before_end")
    on = parse_serve_args(["--decode", "http://h:2", "--guards"]).guards
    assert on.prefill_verdict == "before_first_byte"
    assert parse_serve_args(["--decode", "http://h:2"]).guards.prefill_verdict == "before_first_byte"
    with pytest.raises(ConfigError, match="prefill_verdict"):
        config_from_raw({"guards": {"prefill_verdict": "never"}})


def test_flags_scalars_and_policies() -> None:
    c = parse_serve_args(
        [
            "--host",
            "0.0.0.0",
            "--port",
            "9000",
            "--policy",
            "random",
            "--decode-policy",
            "least_load",
            "--log-level",
            "debug",
            "--no-log-json",
            "--request-timeout-s",
            "30",
            "--max-concurrent",
            "7",
            "--admin-token-env",
            "TOK",
            "--min-prefill-tokens",
            "256",
        ]
    )
    assert (c.listen.host, c.listen.port, c.log_level, c.log_json) == ("0.0.0.0", 9000, "debug", False)
    assert c.policy == RandomCfg() and c.decode_policy == LeastLoadCfg() and c.prefill_policy is None
    assert c.effective_prefill_policy == RandomCfg()
    assert (c.timeouts.total_s, c.limits.max_concurrent, c.admin.token_env) == (30.0, 7, "TOK")
    # phase limits above the new total are lowered to it, smaller ones kept
    assert (
        c.timeouts.prefill_s,
        c.timeouts.idle_s,
        c.timeouts.handoff_s,
        c.timeouts.client_stall_s,
        c.timeouts.connect_s,
    ) == (30, 30, 30, 30, 2)
    assert c.decider.min_prefill_tokens == 256


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill", "http://h:1", "x"], "bootstrap port 'x' is not a number"),
        (["--prefill", "http://h:1", "1", "2"], "--prefill takes URL"),
        (["--policy", "bogus"], "Invalid value 'bogus' - at `$.policy.type`"),
        (["--engine", "openai", "--decode", "http://h:1"], "openai can only be colocated"),
        (["--request-timeout-s", "0"], "--request-timeout-s must be a positive number"),
        (["--decode", "http://h:1", "--decode", "http://h:1"], "duplicate worker"),
    ],
)
def test_flag_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_serve_args(argv)
    assert message in str(e.value)


def test_bad_flag_syntax_exits() -> None:
    with pytest.raises(SystemExit):
        parse_serve_args(["--port", "eighty"])


def test_flags_override_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
policy = "least_load"
log_level = "warning"
[listen]
host = "0.0.0.0"
port = 1234
[timeouts]
total_s = 100
connect_s = 1
[admin]
token = "inline"
[[workers]]
url = "http://file:1"
role = "colocated"
engine = "vllm"
""",
    )
    c = parse_serve_args(
        [
            "--config",
            str(path),
            "--port",
            "4321",
            "--policy",
            "power_of_two",
            "--decode",
            "http://flag:1",
            "--engine",
            "vllm",
            "--request-timeout-s",
            "50",
            "--admin-token-env",
            "T",
        ]
    )
    assert [w.url for w in c.workers] == ["http://file:1", "http://flag:1"]  # appended
    assert c.workers[1].engine is Engine.VLLM
    assert (c.listen.host, c.listen.port) == ("0.0.0.0", 4321)  # scalar replaced, sibling kept
    assert c.policy == PowerOfTwoCfg() and c.log_level == "warning"
    assert (c.timeouts.total_s, c.timeouts.connect_s) == (50.0, 1.0)
    assert c.admin == AdminConfig(token_env="T")
    # without flags the file stands as written
    assert parse_serve_args(["--config", str(path)]) == load_config(path)


def test_flag_errors_mention_file_and_flags(tmp_path: Path) -> None:
    path = write(tmp_path, '[[workers]]\nurl = "http://a:1"\nrole = "decode"\n')
    with pytest.raises(ConfigError, match=r"gw\.toml \+ flags: duplicate worker"):
        parse_serve_args(["--config", str(path), "--decode", "http://a:1"])
