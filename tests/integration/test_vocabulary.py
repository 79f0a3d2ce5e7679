"""Token ids outside the vocabulary, in every spelling a body can carry them in, on every route,
against the real emulator servers (whose SGLang dies on such an id as SGLang 0.5.23 does):
with the workers' `vocab_size` configured each is a 400 naming the parameter, no engine dies,
and the spellings the engines do not read as ids are served."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from emulator.tokenizer import VOCAB_SIZE
from tests.integration.conftest import Cluster, build_cluster, stop_cluster

BIG = 1_000_000  # beyond VOCAB_SIZE (259)
GEN = "/generate"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, body without the model, the parameter the 400 names)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # /generate: SGLang reads input_ids whenever they are given, text beside them or not
    (GEN, {"text": "hi", "input_ids": [5, BIG]}, "input_ids"),
    (GEN, {"input_ids": [5, BIG]}, "input_ids"),
    (GEN, {"input_ids": [[5], [6, BIG]]}, "input_ids"),
    (GEN, {"text": ["a", "b"], "input_ids": [[5], [BIG]]}, "input_ids"),
    (GEN, {"input_ids": [[5], [BIG]], "sampling_params": {"n": 2, "max_new_tokens": 2}}, "input_ids"),
    # stop ids with a minimum length: SGLang's min-new-tokens penalizer scatters them
    (
        GEN,
        {"text": "hi", "sampling_params": {"min_new_tokens": 1, "stop_token_ids": [BIG]}},
        "stop_token_ids",
    ),
    (
        GEN,
        {"text": ["a", "b"], "sampling_params": [{}, {"min_new_tokens": 1, "stop_token_ids": [3, BIG]}]},
        "stop_token_ids",
    ),
    # completions: ids, batches of ids, and pydantic's lax ints (2.0, "7" among ints, true)
    (CMPL, {"prompt": [5, BIG]}, "prompt"),
    (CMPL, {"prompt": [[5], [BIG]]}, "prompt"),
    (CMPL, {"prompt": [5.0, float(BIG)]}, "prompt"),
    (CMPL, {"prompt": [True, str(BIG)]}, "prompt"),
    (CMPL, {"prompt": [[5], [6, str(BIG)]]}, "prompt"),
    (CMPL, {"prompt": [5, BIG], "n": 2}, "prompt"),
    (CMPL, {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [BIG]}, "stop_token_ids"),
    (CMPL, {"prompt": "hi", "min_tokens": 1, "stop_token_ids": [str(BIG)]}, "stop_token_ids"),
    # chat: SGLang 0.5.23 takes `input_ids` as the prompt (the messages' template skipped)
    (CHAT, {"messages": MSG, "input_ids": [5, BIG]}, "input_ids"),
    (CHAT, {"messages": MSG, "input_ids": [5, str(BIG)]}, "input_ids"),
    (CHAT, {"messages": MSG, "input_ids": [5.0, 1e6]}, "input_ids"),
    (CHAT, {"messages": MSG, "input_ids": [5, BIG], "n": 2}, "input_ids"),
    (CHAT, {"messages": MSG, "min_tokens": 1, "stop_token_ids": [BIG]}, "stop_token_ids"),
]

# what no engine reads as token ids: served as usual
SERVED: list[tuple[str, dict[str, Any]]] = [
    (CMPL, {"prompt": ["5", str(BIG)]}),  # strings only: a batch of texts (pydantic's exact match)
    (CMPL, {"prompt": str(BIG)}),  # a text
    (CMPL, {"prompt": "hi", "input_ids": [BIG]}),  # not a completions field: ignored
    (CHAT, {"messages": MSG, "prompt": [BIG]}),  # not a chat field: ignored
    (GEN, {"text": "hi", "prompt": [BIG]}),  # not a /generate field: ignored
    (CHAT, {"messages": MSG, "input_ids": [5, 6, 7]}),  # within the vocabulary
    (GEN, {"text": "hi", "input_ids": [5, 6]}),
]


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if raw else {}


def with_budget(path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == GEN:
        sp = body.get("sampling_params", {})
        if isinstance(sp, dict):
            return {**body, "sampling_params": {"max_new_tokens": 2, **sp}}
        return body
    return {"max_tokens": 2, **body}


@pytest.fixture
async def cluster() -> Any:
    c = await build_cluster(vocab_size=VOCAB_SIZE, colocated_fallback=True)
    yield c
    await stop_cluster(c)


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
async def test_out_of_vocabulary_ids_in_every_spelling_are_a_400(
    cluster: Cluster, path: str, body: dict[str, Any], param: str
) -> None:
    for model in ("m-sglang", "m-vllm") if path != GEN else ("m-sglang",):
        status, out = await post(cluster.url + path, {"model": model, **with_budget(path, body)})
        assert status == 400, (model, out)
        assert out["error"]["param"] == param and "out of vocabulary" in out["error"]["message"], out
    assert not [n for n, e in cluster.emulators.items() if e.dead]


@pytest.mark.parametrize(("path", "body"), SERVED)
async def test_what_no_engine_reads_as_ids_is_served(
    cluster: Cluster, path: str, body: dict[str, Any]
) -> None:
    status, out = await post(cluster.url + path, {"model": "m-sglang", **with_budget(path, body)})
    assert status == 200, out
    assert not [n for n, e in cluster.emulators.items() if e.dead]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (GEN, {"input_ids": [5, -1]}, "input_ids"),
        (CHAT, {"messages": MSG, "input_ids": [-3]}, "input_ids"),
        (CMPL, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        (GEN, {"text": "hi", "input_ids": [[5]]}, "input_ids"),  # one text, a batch of ids
        (GEN, {"text": ["a", "b"], "input_ids": [[5]]}, "input_ids"),  # two texts, one prompt of ids
        (CHAT, {"messages": MSG, "input_ids": ["x"]}, "input_ids"),
    ],
)
async def test_negative_ids_and_mismatched_shapes_are_a_400_whatever_the_vocabulary(
    path: str, body: dict[str, Any], param: str
) -> None:
    c = await build_cluster()  # no vocab_size configured
    try:
        status, out = await post(c.url + path, {"model": "m-sglang", **with_budget(path, body)})
        assert status == 400 and out["error"]["param"] == param, out
        assert not [n for n, e in c.emulators.items() if e.dead]
    finally:
        await stop_cluster(c)


@pytest.mark.parametrize("vocab", [None, VOCAB_SIZE])
async def test_sglang_workers_without_a_vocabulary_size_are_warned_about(vocab: int | None) -> None:
    """Neither engine says its vocabulary size over HTTP (SGLang 0.5.23's /server_info and
    /model_info, vLLM 0.32's endpoints): the gateway cannot learn it, so it says at start which
    SGLang workers run without the check."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        c = await build_cluster(vocab_size=vocab)
    try:
        warned = [e for e in logs if e["event"] == "workers.vocab_size_unknown"]
        if vocab is None:
            assert len(warned) == 1 and warned[0]["workers"] == ["sgl-d", "sgl-p"], warned
            assert warned[0]["log_level"] == "warning"
        else:
            assert warned == []
    finally:
        await stop_cluster(c)
