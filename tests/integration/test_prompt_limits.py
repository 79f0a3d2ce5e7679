"""The length preflight refuses only what an engine would refuse: each prompt of a batch against
the context on its own, a chat by its text (an inline image's base64 is no prompt text). Both
were 400s from the gateway that a direct connection does not give (found by the API probe)."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import Cluster
from tests.integration.test_gateway import post


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_a_batch_whose_prompts_each_fit_is_served(cluster: Cluster, model: str) -> None:
    """Two 5000-token prompts against an 8192-token context: each fits, the sum does not."""
    body = {"model": model, "prompt": [[11] * 5000, [12] * 5000], "max_tokens": 4, "temperature": 0}
    status, _, raw = await post(cluster.url + "/v1/completions", body)
    assert status == 200, raw
    _, _, ref = await post(cluster.reference[model].url + "/v1/completions", body)
    texts = [c["text"] for c in sorted(json.loads(raw)["choices"], key=lambda c: c["index"])]
    assert texts == [c["text"] for c in sorted(json.loads(ref)["choices"], key=lambda c: c["index"])]
    too_long = body | {"prompt": [[11] * 5000, [12] * 9000]}
    status, _, raw = await post(cluster.url + "/v1/completions", too_long)
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded", raw


async def test_a_generate_batch_whose_prompts_each_fit_is_served(cluster: Cluster) -> None:
    body = {
        "input_ids": [[11] * 5000, [12] * 5000],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    status, _, raw = await post(cluster.url + "/generate", body)
    assert status == 200, raw
    _, _, ref = await post(cluster.reference["m-sglang"].url + "/generate", body)
    assert [d["text"] for d in json.loads(raw)] == [d["text"] for d in json.loads(ref)]


async def test_a_generate_batch_with_a_budget_per_prompt_checks_each_prompt_with_its_own(
    cluster: Cluster,
) -> None:
    """A long prompt with a small budget and a short one with a large budget: each fits an
    8192-token context, the largest prompt with the largest budget would not."""
    body = {
        "input_ids": [[11] * 7000, [12] * 10],
        "sampling_params": [
            {"max_new_tokens": 3, "temperature": 0},
            {"max_new_tokens": 1200, "temperature": 0},
        ],
    }
    status, _, raw = await post(cluster.url + "/generate", body)
    ref_status, _, ref = await post(cluster.reference["m-sglang"].url + "/generate", body)
    assert status == ref_status == 200, (raw, ref)
    assert [d["text"] for d in json.loads(raw)] == [d["text"] for d in json.loads(ref)]
    # the short prompt's budget no longer fits with the long prompt; the pair that fails is named
    too_long = body | {"input_ids": [[11] * 10, [12] * 7000]}
    status, _, raw = await post(cluster.url + "/generate", too_long)
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "context_length_exceeded", raw
    assert "prompt 1 of the batch" in err["message"], err


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_a_chat_with_an_inline_image_is_not_too_long(cluster: Cluster, model: str) -> None:
    image = "data:image/png;base64," + "iVBORw0KGgo" * 12_000  # ~130 KB of base64
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": image}},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    status, _, raw = await post(cluster.url + "/v1/chat/completions", body)
    ref_status, _, ref = await post(cluster.reference[model].url + "/v1/chat/completions", body)
    assert status == ref_status == 200, (raw, ref)
    assert json.loads(raw)["choices"][0]["message"] == json.loads(ref)["choices"][0]["message"]
