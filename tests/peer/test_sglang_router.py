"""Peer check: the real sglang-router (PyPI, P/D mode) drives emulated SGLang prefill + decode.

The router is unmodified; it injects `bootstrap_host/port/room`, sends the same body to both
workers concurrently and returns the decode's answer. Greedy output through it must equal a
colocated (`--role both`) emulated server's, token for token, streaming and not, and the
emulators must show that a real KV transfer carried every answer.
"""

from __future__ import annotations

import pytest

from tests.peer.helpers import (
    MAX_TOKENS,
    MODEL,
    PeerCluster,
    assert_concurrent_requests_pair,
    assert_corrupt_kv_changes_tokens,
    body_for,
    compare,
    post,
    set_faults,
    tokens_of,
)

pytestmark = [pytest.mark.peer, pytest.mark.timeout(180)]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Prefill and decode disaggregation moves the KV cache from one server to another, so",
]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_same_tokens_as_colocated(sglang_pd: PeerCluster, path: str, stream: bool) -> None:
    for prompt in PROMPTS:
        got = compare(sglang_pd, path, body_for(path, prompt, stream=stream), stream=stream)
        if stream:
            assert len(got.pieces) > 1, "a stream arrived as one event"


def test_batch_prompts_use_one_room_each(sglang_pd: PeerCluster) -> None:
    """A prompt list makes the router send lists of bootstrap hosts/ports/rooms."""
    body = {"model": MODEL, "prompt": PROMPTS[:2], "max_tokens": MAX_TOKENS, "temperature": 0}
    before = sglang_pd.kv_counters()
    routed = post(sglang_pd.router_url, "/v1/completions", body)
    direct = post(sglang_pd.colocated_url, "/v1/completions", body)
    after = sglang_pd.kv_counters()
    for i in range(2):
        assert tokens_of("/v1/completions", routed, stream=False, index=i) == tokens_of(
            "/v1/completions", direct, stream=False, index=i
        )
    assert after["decode.kv_transfers_ok"] - before["decode.kv_transfers_ok"] >= 2, (before, after)
    assert after["kv_transfers_failed"] == before["kv_transfers_failed"]


def test_generate_input_ids_batch(sglang_pd: PeerCluster) -> None:
    body = {
        "input_ids": [[101, 102, 103, 104, 105], [7, 8, 9]],
        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
    }
    routed = post(sglang_pd.router_url, "/generate", body)
    direct = post(sglang_pd.colocated_url, "/generate", body)
    for i in range(2):
        assert tokens_of("/generate", routed, stream=False, index=i) == tokens_of(
            "/generate", direct, stream=False, index=i
        )


def test_return_logprob_joins_both_legs(sglang_pd: PeerCluster) -> None:
    """With `return_logprob` the router awaits the prefill too and merges input logprobs."""
    body = body_for("/generate", PROMPTS[0], stream=False) | {"return_logprob": True}
    routed = post(sglang_pd.router_url, "/generate", body)
    direct = post(sglang_pd.colocated_url, "/generate", body)
    got = tokens_of("/generate", routed, stream=False)
    want = tokens_of("/generate", direct, stream=False)
    assert (got.text, got.completion_tokens, got.output_ids) == (
        want.text,
        want.completion_tokens,
        want.output_ids,
    )
    got_out = got.extra["meta_info"].get("output_token_logprobs")
    want_out = want.extra["meta_info"].get("output_token_logprobs")
    assert got_out == want_out
    # The router prepends the prefill's input_token_logprobs to the decode's (sglang-router 0.3.2,
    # seen on loopback; `pd_router.rs` merges them so).
    assert got.extra["meta_info"].get("input_token_logprobs")


def test_concurrent_requests_each_find_their_kv(sglang_pd: PeerCluster) -> None:
    """16 requests at once: every decode must pair with its own prefill by room."""
    assert_concurrent_requests_pair(sglang_pd)


def test_router_rejects_text_list_on_generate(sglang_pd: PeerCluster) -> None:
    """Quirk of sglang-router 0.3.2: `/generate` with `text: [...]` is its own 422 ("text:
    invalid type: sequence, expected a string"), never sent to a worker."""
    body = {"text": PROMPTS[:2], "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    assert post(sglang_pd.router_url, "/generate", body).status == 422


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_corrupt_kv_is_visible_through_the_router(sglang_pd: PeerCluster, path: str) -> None:
    """The prefill ships random bytes as KV: 200 with other tokens (a silent failure)."""
    assert_corrupt_kv_changes_tokens(sglang_pd, path, "bogus_kv_params:1")


def test_prefill_rejection_reaches_the_client(sglang_pd: PeerCluster) -> None:
    """SGLang #30233 shape: the prefill aborts the prompt with 400 but still ships a 1-token KV.

    sglang-router 0.3.2 does not only await the decode: a prefill that fails fast has its
    status surfaced to the client (`prefill_bad_request`), so the decode's garbage is dropped.
    """
    body = body_for("/generate", PROMPTS[2], stream=False)
    set_faults(sglang_pd.prefill, ["silent_truncation:1"])
    try:
        r = post(sglang_pd.router_url, "/generate", body)
    finally:
        set_faults(sglang_pd.prefill, [])
    assert r.status == 400, (r.status, r.body[:300])
    assert b"prefill" in r.body.lower()
