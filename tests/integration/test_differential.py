"""Differential test: random combinations of request parameters, each sent through the gateway's
P/D and to a colocated server of the same engine; the answers must be the same.

The combinations cover both engines and every route, stream and not, `n` 1-3, batches, greedy and
seeded sampling, stop strings, `ignore_eos`, logprobs (with `echo`), usage in streams: the
interactions (a split `n` with a stop string, a batch with echo and logprobs...) that one test per
parameter does not reach. Seeded, so a failure replays; `PDGW_DIFF_EXAMPLES` runs more.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import aiohttp

from tests.integration.conftest import Cluster
from tests.integration.test_gateway import sse_events

EXAMPLES = int(os.environ.get("PDGW_DIFF_EXAMPLES", "300"))
WORDS = ["alpha", "beta", "gamma", "delta", "once", "upon", "a", "time", "the", "cat", "Grüße", "東京"]


def make_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    model = rng.choice(["m-sglang", "m-vllm"])
    route = rng.choice(
        ["/v1/completions", "/v1/chat/completions"] + (["/generate"] if model == "m-sglang" else [])
    )
    stream = rng.random() < 0.5
    n = rng.choice([1, 1, 2, 3])
    max_tokens = rng.randint(1, 20)
    seeded = rng.random() < 0.4

    def prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))

    if route == "/generate":
        sp: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": 0.8 if seeded else 0, "n": n}
        if seeded:
            sp["sampling_seed"] = rng.randint(0, 1000)
        if rng.random() < 0.3:
            sp["stop"] = [rng.choice("abcdefgh")]
        if rng.random() < 0.2:
            sp["ignore_eos"] = True
        text: Any = [prompt() for _ in range(rng.randint(2, 3))] if rng.random() < 0.3 else prompt()
        body: dict[str, Any] = {"model": model, "text": text, "sampling_params": sp, "stream": stream}
        if rng.random() < 0.3:
            body["return_logprob"] = True
        return route, body
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.8 if seeded else 0,
        "n": n,
        "stream": stream,
    }
    if seeded:
        body["seed"] = rng.randint(0, 1000)
    if route == "/v1/completions":
        body["prompt"] = [prompt() for _ in range(rng.randint(2, 3))] if rng.random() < 0.3 else prompt()
        if rng.random() < 0.3:
            body["logprobs"] = rng.choice([0, 1, 2])
        if rng.random() < 0.2:
            body["echo"] = True
    else:
        body["messages"] = [{"role": "user", "content": prompt()}]
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.3:
        body["stop"] = [rng.choice("abcdefgh")]
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    return route, body


def essence(route: str, raw: bytes, stream: bool) -> Any:
    """What must agree: per choice its text, finish reason and logprobs; the usage's tokens."""
    if not stream:
        data = json.loads(raw)
        if route == "/generate":
            items = data if isinstance(data, list) else [data]
            return sorted(
                (
                    x.get("index", 0),
                    x["text"],
                    (x["meta_info"].get("finish_reason") or {}).get("type"),
                    x["meta_info"].get("completion_tokens"),
                    json.dumps(x["meta_info"].get("output_token_logprobs")),
                )
                for x in items
            )
        choices = sorted(
            (
                c["index"],
                c["message"]["content"] if "message" in c else c["text"],
                c["finish_reason"],
                json.dumps(c.get("logprobs"), sort_keys=True),
            )
            for c in data["choices"]
        )
        return choices, (data.get("usage") or {}).get("completion_tokens")
    events = [e for e in sse_events(raw) if e != "[DONE]"]
    assert sse_events(raw)[-1] == "[DONE]"
    if route == "/generate":
        last: dict[int, Any] = {}
        for e in events:
            fr = e["meta_info"].get("finish_reason")
            last[e.get("index", 0)] = (e["text"], fr.get("type") if fr else None)
        return sorted(last.items())
    parts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for e in events:
        if e.get("usage"):
            usage = e["usage"].get("completion_tokens")
        for c in e.get("choices", []):
            piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
            parts[c["index"]] = parts.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    return sorted(parts.items()), sorted(finish.items()), usage


async def test_random_requests_through_pd_equal_colocated(cluster: Cluster) -> None:
    rng = random.Random(20261129)
    headers = {"content-type": "application/json"}
    compared = refused = 0
    async with aiohttp.ClientSession() as s:
        for _ in range(EXAMPLES):
            route, body = make_request(rng)
            data = json.dumps(body).encode()
            async with s.post(cluster.url + route, data=data, headers=headers) as r:
                status, raw = r.status, await r.read()
            async with s.post(cluster.reference[body["model"]].url + route, data=data, headers=headers) as r:
                ref_status, ref = r.status, await r.read()
            what = f"{route} {data.decode()}"
            if body["model"] == "m-sglang" and body.get("echo") and body.get("logprobs"):
                # the prompt's logprobs: only the pair's prefill has them (test_prompt_scoring.py)
                assert status == 400 and json.loads(raw)["error"]["param"] == "echo", what
                refused += 1
                continue
            assert status == ref_status, (what, raw[:400], ref[:400])
            if status == 200:
                assert essence(route, raw, body["stream"]) == essence(route, ref, body["stream"]), what
                compared += 1
    assert compared > EXAMPLES * 0.8 and refused < EXAMPLES * 0.1
    text = cluster.gateway.metrics.render().decode()
    assert "pdgw_guard_failures_total{" not in text  # no answer was taken for a broken handoff
