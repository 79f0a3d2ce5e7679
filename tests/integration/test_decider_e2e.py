"""The cost-model decider end to end: `pd-gateway serve` (a subprocess, configured by a TOML file
and `--decider cost_model`) in front of an emulated SGLang cluster (prefill, decode, colocated:
emulator subprocesses timed as Llama-3-8B on an H100), driven by the `openai` client.

On an idle cluster a short prompt is served colocated (the handoff's fixed cost is more than a
local prefill's share of a tiny prompt) and a long one disaggregated (its prefill would stall the
colocated worker's decodes for longer than its KV takes to move); each verdict is in the access
log line (`decision`), and what the model learned is on /metrics."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from emulator.api import EmulatorProcess, EmulatorSpec, spawn_emulator
from tests.integration.test_cli_serve import BIN, free_port, wait_ready

MODEL = "decider-model"
LOGS = ("--log-level", "info", "--log-json")
LONG_CHARS = 20_000  # one token a byte (the emulator's tokenizer): ~0.8 s of prefill on an H100


@pytest.fixture
def sglang_cluster() -> Iterator[dict[str, EmulatorProcess]]:
    specs = {
        "p": EmulatorSpec(engine="sglang", role="prefill", model=MODEL, time_scale=1.0, max_model_len=32768),
        "d": EmulatorSpec(engine="sglang", role="decode", model=MODEL, time_scale=1.0, max_model_len=32768),
        "c": EmulatorSpec(engine="sglang", role="both", model=MODEL, time_scale=1.0, max_model_len=32768),
    }
    started: dict[str, EmulatorProcess] = {}
    try:
        for name, spec in specs.items():
            started[name] = spawn_emulator(spec)
        yield started
    finally:
        for e in started.values():
            e.terminate()


def _config(tmp_path: Path, emus: dict[str, EmulatorProcess]) -> Path:
    p, d, c = emus["p"], emus["d"], emus["c"]
    cfg = tmp_path / "gw.toml"
    cfg.write_text(
        "[guards]\nchars_per_token_estimate = 1.0\n\n"  # the emulator's tokenizer: a token a byte
        "[decider]\nttft_slo_s = 3.0\ntpot_slo_s = 0.2\n\n"
        f'[[workers]]\nid = "sgl-p"\nurl = "{p.url}"\nrole = "prefill"\nengine = "sglang"\n'
        f"bootstrap_port = {p.spec.bootstrap_port}\n\n"
        f'[[workers]]\nid = "sgl-d"\nurl = "{d.url}"\nrole = "decode"\nengine = "sglang"\n\n'
        f'[[workers]]\nid = "sgl-c"\nurl = "{c.url}"\nrole = "colocated"\nengine = "sglang"\n'
    )
    return cfg


def _done_lines(log: Path) -> dict[str, dict[str, object]]:
    out = {}
    for line in log.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "request.done":
            out[e["request_id"]] = e
    return out


def test_short_prompts_go_colocated_and_long_ones_disaggregated(
    sglang_cluster: dict[str, EmulatorProcess], tmp_path: Path
) -> None:
    cfg = _config(tmp_path, sglang_cluster)
    port = free_port()
    log = tmp_path / "gw.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN), "serve", "--config", str(cfg), "--port", str(port), "--decider", "cost_model", *LOGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        long_prompt = ("the quick brown fox jumps over the lazy dog " * 1000)[:LONG_CHARS]
        sent: dict[str, str] = {}
        for i in range(4):
            for kind, prompt in (("short", "hi"), ("long", long_prompt)):
                rid = f"{kind}-{i}"
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=8,
                    stream=True,
                    extra_headers={"x-request-id": rid},
                )
                text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
                assert text
                sent[rid] = kind
        deadline = time.monotonic() + 10
        while len(done := _done_lines(log)) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.1)
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            metrics = r.read().decode()
        learned = [x for x in metrics.splitlines() if x.startswith("pdgw_decider")]
        for rid, kind in sent.items():
            e = done[rid]
            why = json.dumps({**e, "learned": learned}, indent=0)
            assert e["outcome"] == "ok", why
            if kind == "short":
                assert (e["plan"], e["decode"]) == ("colocated", "sgl-c"), why
                assert str(e["decision"]).startswith("cost:colocated:"), why
            else:
                assert (e["plan"], e["prefill"], e["decode"]) == ("disaggregated", "sgl-p", "sgl-d"), why
                assert str(e["decision"]).startswith("cost:pd:"), why
        # learned from the outcomes: the prefill speeds of both prefilling workers, the pair's
        # handoff, and the verdicts by reason
        for needle in (
            'pdgw_decider_prefill_rate_tokens_per_second{worker="sgl-p"}',
            'pdgw_decider_prefill_rate_tokens_per_second{worker="sgl-c"}',
            'pdgw_decider_transfer_seconds_per_token{decode="sgl-d",prefill="sgl-p"}',
            'pdgw_decider_verdicts_total{reason="cost:colocated:feasible"} 4.0',
        ):
            assert needle in metrics, metrics[-3000:]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
