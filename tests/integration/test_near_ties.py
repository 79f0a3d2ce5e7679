"""A vLLM decode samples the first token again (it recomputes the prompt's last token over the
pulled KV), so where the prefill's two best first tokens are near-tied, numerics that differ
between the legs may make it draw the runner-up. That answer is correct: the guard must not
fail it. The emulator's `tie_flip` fault makes the decode draw the runner-up wherever its model
has a near tie (about one first token in eight; `emulator.model.tie_gap`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.config import GuardsConfig
from tests.integration.conftest import Cluster, build_cluster, stop_cluster
from tests.integration.test_gateway import body_for, generated, post

ROUTES = ["/v1/completions", "/v1/chat/completions"]


@pytest.fixture(params=[3, 0], ids=["asked", "not_asked"])
async def flipping(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Cluster, int]]:
    # no sampled verification: a sampled tie is served again elsewhere (the test below)
    guards = GuardsConfig(near_tie_alternatives=request.param, shadow_fraction=0.0)
    c = await build_cluster(faults={"vllm-d": ["tie_flip"]}, guards=guards)
    try:
        yield c, request.param
    finally:
        await stop_cluster(c)


def _count(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_decode_on_the_other_side_of_a_near_tie_is_no_failure(
    flipping: tuple[Cluster, int], route: str, stream: bool
) -> None:
    """With the prefill asked for its best first tokens (the default), an answer whose first
    token is the prefill's near-tied runner-up is delivered as the decode drew it: no guard
    failure, retry or fallback, counted in `pdgw_guard_near_ties_total`. Not asked, the same
    answers are guard failures (each served again elsewhere): the check this test guards."""
    cluster, asked = flipping
    flipped = 0
    for i in range(40):
        body = body_for(route, "m-vllm", f"near tie {i}", stream, max_tokens=6)
        s, _, raw = await post(cluster.url + route, body)
        assert s == 200, raw
        got = generated(route, raw, stream)[0]
        _, _, ref = await post(cluster.reference["m-vllm"].url + route, body)
        want = generated(route, ref, stream)[0]
        if got != want:
            assert asked and got[1:] == want[1:] and got[0] != want[0], (got, want)
            flipped += 1
    text = cluster.gateway.metrics.render().decode()
    failures = _count(text, 'pdgw_guard_failures_total{guard="decode_consistency"')
    ties = _count(text, "pdgw_guard_near_ties_total")
    if asked:
        assert flipped > 0  # about one prompt in eight ties
        assert ties == flipped and failures == 0
        for name in ("upstream_errors", "retries", "fallbacks", "guard_failures"):
            assert f"pdgw_{name}_total{{" not in text, name
    else:
        assert failures > 0 and ties == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_near_tie_answer_that_differs_from_its_re_run_suspects_no_pair(stream: bool) -> None:
    """With every greedy answer verified (`shadow_fraction = 1.0`; the default samples 5 %), an
    answer that went on from the prefill's near-tied runner-up differs from its re-run, which
    takes the prefill's own token. Numerics do that to sound answers, and so can a wrong KV
    whose first token happens to be a near tie: a whole answer is served again elsewhere (the
    client gets the re-run's tokens, never an unverified tie), a stream, whose first tokens went
    out, ends with an error event instead of `[DONE]`; the pair is not made suspect for it,
    else a pair whose first tokens tie now and then would be verified for good."""
    c = await build_cluster(faults={"vllm-d": ["tie_flip"]}, guards=GuardsConfig(shadow_fraction=1.0))
    try:
        route = "/v1/completions"
        for i in range(40):
            body = body_for(route, "m-vllm", f"near tie {i}", stream, max_tokens=6)
            s, _, raw = await post(c.url + route, body)
            assert s == 200, raw
            _, _, ref = await post(c.reference["m-vllm"].url + route, body)
            if generated(route, raw, stream) != generated(route, ref, stream):
                assert stream and b"[DONE]" not in raw and b'"error"' in raw, raw
        text = c.gateway.metrics.render().decode()
        ties = _count(text, "pdgw_guard_near_ties_total")
        assert ties > 0  # about one prompt in eight
        assert _count(text, 'pdgw_guard_failures_total{guard="shadow"') >= ties
        assert not c.gateway.registry.suspect_pairs()
    finally:
        await stop_cluster(c)


async def test_a_prefill_that_takes_fewer_logprobs_is_asked_for_none() -> None:
    """A vLLM prefill run with `--max-logprobs` below `near_tie_alternatives` refuses the near-tie
    logprobs with a 400: its first such request is sent again without them, and the worker is
    asked for none until its next full info read (it may have restarted allowing more), which
    asks once again. The client sees no error; one that asks more logprobs than the
    worker allows itself still gets vLLM's own 400."""
    cluster = await build_cluster(vllm_prefill_max_logprobs=1)
    health = cluster.gateway.health
    health.info_every = 10**9  # reads only when told
    try:
        for i in range(4):
            for route in ROUTES:
                body = body_for(route, "m-vllm", f"few logprobs {i}", i % 2 == 1, max_tokens=5)
                s, _, raw = await post(cluster.url + route, body)
                assert s == 200, raw
                _, _, ref = await post(cluster.reference["m-vllm"].url + route, body)
                assert generated(route, raw, i % 2 == 1) == generated(route, ref, i % 2 == 1)
        w = cluster.gateway.registry.get("vllm-p")
        assert w.near_ties is False
        # the next full info read asks again (it may have restarted allowing more); still refused,
        # that is one prefill sent twice, and the client sees nothing of it
        health.info_every = 1
        assert await health.probe(w)
        health.info_every = 10**9
        assert w.near_ties is True
        body = body_for("/v1/completions", "m-vllm", "asked again", False, max_tokens=5)
        s, _, raw = await post(cluster.url + "/v1/completions", body)
        assert s == 200, raw
        assert w.near_ties is False
        text = cluster.gateway.metrics.render().decode()
        for name in ("upstream_errors", "retries", "fallbacks", "guard_failures"):
            assert f"pdgw_{name}_total{{" not in text, name
        body = body_for("/v1/completions", "m-vllm", "too many", False)
        body["logprobs"] = 2
        s, _, raw = await post(cluster.url + "/v1/completions", body)
        assert s == 400 and b"Requested sample logprobs of 2" in raw, raw
    finally:
        await stop_cluster(cluster)
