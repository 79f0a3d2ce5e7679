"""SGLang's native `/generate` through the gateway's P/D, against the real engines: the same
tokens as the single server, whole and streamed, for one prompt and a batch, and with
`return_logprob` the prompt's logprobs merged from the prefill exactly once per position
(sglang-router 0.3.2 prepends the prefill's `meta_info.input_token_logprobs` to the decode's,
so the decode's first entry comes twice: seen on loopback against stub engines)."""

from __future__ import annotations

import json
import os
import urllib.error
from typing import Any

import pytest

from tests.e2e._support import Lane, post_json, unique_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _sglang_only(lane: Lane) -> None:
    if lane.engine != "sglang":
        pytest.skip("/generate is SGLang's")


def generate(base: str, body: dict[str, Any]) -> Any:
    raw = post_json(base + "/generate", body)
    if not body.get("stream"):
        return json.loads(raw)
    events = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
            events.append(json.loads(line[5:]))
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]
    return events


def last_per_index(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last: dict[int, dict[str, Any]] = {}
    for e in events:
        last[e.get("index", 0)] = e
    return [last[i] for i in sorted(last)]


def close(a: list[Any], b: list[Any]) -> bool:
    """Logprob lists ([logprob, token id, text?] per position) equal, logprobs to 1e-3."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x[1] != y[1]:
            return False
        if (x[0] is None) != (y[0] is None) or (x[0] is not None and abs(x[0] - y[0]) > 1e-3):
            return False
    return True


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_equals_single_server(lane: Lane, stream: bool) -> None:
    body = {
        "text": unique_prompt(40, f"generate-{stream}"),
        "stream": stream,
        # the prompt is random: without ignore_eos the tiny model sometimes ends at once (seen in CI)
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    }
    got, want = generate(lane.gateway, body), generate(lane.reference, body)
    if stream:
        got, want = last_per_index(got), last_per_index(want)
        assert len(got) == 1
        got, want = got[0], want[0]
    assert got["output_ids"] == want["output_ids"] and len(got["output_ids"]) == 12
    assert got["text"] == want["text"]
    assert got["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_batch_of_token_ids_equals_single_server(lane: Lane, stream: bool) -> None:
    body = {
        "input_ids": [[1, 45, 499, 173], [1, 90, 250, 263, 93, 72], [1, 306]],
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    }
    got, want = generate(lane.gateway, body), generate(lane.reference, body)
    if stream:
        got, want = last_per_index(got), last_per_index(want)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert len(got) == 3


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_sampling_params_per_prompt_equals_single_server(lane: Lane, stream: bool, n: int) -> None:
    """`sampling_params` as a list, one object per prompt of the batch: each prompt keeps its
    own limit through P/D (with n = 2, split into one handoff per sample), as on the single
    server."""
    body = {
        "input_ids": [[1, 45, 499, 173], [1, 90, 250, 263, 93, 72], [1, 306]],
        "stream": stream,
        "sampling_params": [
            {"temperature": 0, "max_new_tokens": 3, "n": n},
            {"temperature": 0, "max_new_tokens": 9, "n": n},
            {"temperature": 0, "max_new_tokens": 5, "n": n},
        ],
    }
    got, want = generate(lane.gateway, body), generate(lane.reference, body)
    if stream:
        got, want = last_per_index(got), last_per_index(want)
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]
    assert [len(o["output_ids"]) for o in got] == [k for k in (3, 9, 5) for _ in range(n)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_prompt_logprobs_are_merged_once_per_position(lane: Lane, stream: bool) -> None:
    body = {
        "text": unique_prompt(20, f"logprob-{stream}"),
        "stream": stream,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"temperature": 0, "max_new_tokens": 6},
    }
    got, want = generate(lane.gateway, body), generate(lane.reference, body)
    if stream:
        got, want = last_per_index(got)[0], last_per_index(want)[0]
    g, w = got["meta_info"], want["meta_info"]
    assert got["output_ids"] == want["output_ids"]
    # every prompt position once, with the single server's logprobs
    assert len(g["input_token_logprobs"]) == len(w["input_token_logprobs"]) == w["prompt_tokens"]
    assert close(g["input_token_logprobs"], w["input_token_logprobs"])
    assert close(g["output_token_logprobs"], w["output_token_logprobs"])


def test_token_ids_outside_the_vocabulary_are_refused_before_the_engines(lane: Lane) -> None:
    """Real SGLang 0.5.23 does not check prompt ids: one beyond the vocabulary kills its
    scheduler, and the server with it (seen here, on the prefill and the single server). The
    lane's gateway knows the model's vocabulary (`--vocab-size`) and answers 400 instead."""
    vocab = int(os.environ["E2E_VOCAB_SIZE"])
    body = {"input_ids": [1, 45, vocab + 7], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    with pytest.raises(urllib.error.HTTPError) as ei:
        post_json(lane.gateway + "/generate", body, timeout=30)
    assert ei.value.code == 400
    assert "out of vocabulary" in json.loads(ei.value.read())["error"]["message"]
    # the engines are still up and serve the next request P/D
    got = generate(lane.gateway, body | {"input_ids": [1, 45, vocab - 1]})
    assert len(got["output_ids"]) == 4
