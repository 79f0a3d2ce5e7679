"""`stream_options.continuous_usage_stats` through a P/D handoff: the client sees the usage the
engine would have sent it directly, although the gateway asks the decode for the final usage
chunk its guard reads (adapters/_body.py `ask_stream_usage`).

The engines differ (their source): vLLM sends per-chunk usage only with `include_usage` too
(`include_continuous_usage = include_usage and continuous_usage_stats`,
vllm/entrypoints/serve/utils/api_utils.py:289-301); SGLang sends it whenever
`continuous_usage_stats` is set (sglang/srt/entrypoints/openai/utils.py:250-264) and only the
final chunk depends on `include_usage`. The emulators answer so, and each P/D answer is compared
with its model's colocated reference, asked directly."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_gateway import body_for, generated, post, sse_events


def usage_shape(raw: bytes) -> list[tuple[bool, Any, bool]]:
    """Per event: whether it is a usage-only chunk (no choices), its usage's counts, and whether
    it carries the engine's system fingerprint (vLLM stamps the terminal chunks with it when no
    usage chunk follows)."""
    out = []
    for e in sse_events(raw):
        if e == "[DONE]":
            continue
        u = e.get("usage")
        counts = None if u is None else (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])
        out.append((e.get("choices") == [], counts, "system_fingerprint" in e))
    return out


OPTIONS: list[dict[str, Any] | None] = [
    None,
    {"continuous_usage_stats": True},
    {"continuous_usage_stats": True, "include_usage": False},
    {"continuous_usage_stats": True, "include_usage": True},
    {"include_usage": True},
    {"continuous_usage_stats": False},
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: json.dumps(o, separators=(",", ":")))
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("model", ["m-vllm", "m-sglang"])
async def test_stream_usage_is_what_the_engine_sends_directly(
    cluster: Cluster, model: str, route: str, options: dict[str, Any] | None
) -> None:
    body = body_for(route, model, "usage, please", True, max_tokens=6)
    if options is not None:
        body["stream_options"] = options
    options = options or {}
    status, _, raw = await post(cluster.url + route, body)
    assert status == 200, raw
    _, _, ref = await post(cluster.reference[model].url + route, body)
    assert generated(route, raw, True) == generated(route, ref, True)
    got, want = usage_shape(raw), usage_shape(ref)
    assert got == want, (got, want)
    if not options.get("include_usage") and (model == "m-vllm" or not options.get("continuous_usage_stats")):
        assert b'"usage":{' not in raw  # nothing the client did not ask for


async def test_the_reference_engines_differ_as_their_source_says(cluster: Cluster) -> None:
    """The emulators themselves (what the test above compares with): continuous_usage_stats alone
    gives vLLM no usage (and its fingerprint on the terminal chunk) and SGLang per-chunk usage
    without the final chunk."""
    body = {
        "prompt": "x",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(cluster.reference["m-vllm"].url + "/v1/completions", json=body) as r:
            vllm = usage_shape(await r.read())
        async with http.post(cluster.reference["m-sglang"].url + "/v1/completions", json=body) as r:
            sglang = usage_shape(await r.read())
    assert all(u is None for _, u, _ in vllm)
    assert [stamped for _, _, stamped in vllm] == [False] * (len(vllm) - 1) + [True]
    assert all(u is not None and not only for only, u, _ in sglang)
    assert [u[1] for _, u, _ in sglang if u is not None][-1] == 3


def usage_by_choice(raw: bytes) -> tuple[dict[int, list[Any]], list[Any]]:
    """Per choice index, the usage counts its content chunks carry (in order), and the usage-only
    chunks' counts: what a split stream must keep, whichever way the samples interleave."""
    per: dict[int, list[Any]] = {}
    only: list[Any] = []
    for e in sse_events(raw):
        if e == "[DONE]":
            continue
        u = e.get("usage")
        counts = None if u is None else (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])
        if not e.get("choices"):
            only.append(counts)
        for c in e.get("choices") or ():
            per.setdefault(c["index"], []).append(counts)
    return per, only


@pytest.mark.parametrize("options", OPTIONS[1:], ids=lambda o: json.dumps(o, separators=(",", ":")))
@pytest.mark.parametrize("split", [{"n": 2}, {"prompt": ["usage, please", "and a second prompt"]}])
async def test_split_sglang_streams_keep_the_engines_usage(
    cluster: Cluster, split: dict[str, Any], options: dict[str, Any]
) -> None:
    """SGLang P/D runs `n > 1` and batches as one handoff per sample (gateway/samples.py): each
    content chunk keeps its own choice's running usage (continuous_usage_stats), and the summed
    usage chunk comes only when the client asked for it (include_usage), as from SGLang itself."""
    body = {**body_for("/v1/completions", "m-sglang", "usage, please", True, max_tokens=5), **split}
    body["stream_options"] = options
    status, _, raw = await post(cluster.url + "/v1/completions", body)
    assert status == 200, raw
    _, _, ref = await post(cluster.reference["m-sglang"].url + "/v1/completions", body)
    assert usage_by_choice(raw) == usage_by_choice(ref)
