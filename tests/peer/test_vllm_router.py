"""Peer check: the real vllm-router (PyPI, `--vllm-pd-disaggregation`, NIXL) drives emulated vLLM P/D.

The router is unmodified: it sends the prefill a copy with `max_tokens: 1`, `min_tokens: 1`,
`stream: false` and `kv_transfer_params{do_remote_decode: true}`, then the decode the original
body plus the prefill's returned `kv_transfer_params`, with its own `X-Request-Id` on both
legs. Greedy output through it must equal a colocated emulated vLLM server's, token for token,
streaming and not, and every answer must have come through a real KV pull (a decode that got
no params would recompute the prompt and still answer the same, so the counters matter).
"""

from __future__ import annotations

import pytest

from tests.peer.helpers import (
    PeerCluster,
    assert_concurrent_requests_pair,
    assert_corrupt_kv_changes_tokens,
    body_for,
    compare,
    post,
)

pytestmark = [pytest.mark.peer, pytest.mark.timeout(180)]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Prefill and decode disaggregation moves the KV cache from one server to another, so",
]


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_same_tokens_as_colocated(vllm_pd: PeerCluster, path: str, stream: bool) -> None:
    for prompt in PROMPTS:
        got = compare(vllm_pd, path, body_for(path, prompt, stream=stream), stream=stream)
        if stream:
            assert len(got.pieces) > 1, "a stream arrived as one event"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_include_usage(vllm_pd: PeerCluster, path: str) -> None:
    """`stream_options` is stripped for the prefill leg and kept for the decode leg."""
    body = body_for(path, PROMPTS[2], stream=True) | {"stream_options": {"include_usage": True}}
    got = compare(vllm_pd, path, body, stream=True)
    assert got.completion_tokens is not None, "no usage chunk in the stream"


def test_client_request_id_is_echoed(vllm_pd: PeerCluster) -> None:
    """vllm-router replaces X-Request-Id on the legs but still answers with the client's id."""
    body = body_for("/v1/completions", PROMPTS[0], stream=False)
    r = post(vllm_pd.router_url, "/v1/completions", body, headers={"X-Request-Id": "peer-check-42"})
    assert r.status == 200, r.body[:300]
    assert r.headers.get("x-request-id") == "peer-check-42"


def test_concurrent_requests_each_find_their_kv(vllm_pd: PeerCluster) -> None:
    """16 requests at once: every decode must pull its own prefill's blocks."""
    assert_concurrent_requests_pair(vllm_pd)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_truncated_kv_is_visible_through_the_router(vllm_pd: PeerCluster, path: str) -> None:
    """The prefill keeps only one token's KV for the decode: 200 with other tokens."""
    assert_corrupt_kv_changes_tokens(vllm_pd, path, "silent_truncation:1")
