"""Which events the orchestrator builds for the policy: a served request's `Completed` only
for a policy that observes it (`policies.base.wants`).

Round robin's parts follow routing alone (`observes = (Routed,)`), and the orchestrator used to
build a `Completed` (its legs, its timings) per served request for them to drop. A policy that
names what it observes now gets nothing else built; one that does not name it gets every event,
as before. The real gateway in front of emulated engines; the policy's events are read as the
orchestrator sends them.
"""

from __future__ import annotations

import aiohttp
import pytest

from policies.base import Completed, Failed, Routed, WorkerGone, wants
from policies.round_robin import make_policy
from tests.integration.conftest import Cluster, RecordingPolicy


async def served(c: Cluster, model: str) -> None:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    async with aiohttp.ClientSession() as s, s.post(f"{c.url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


@pytest.mark.parametrize("model", ["m-sglang", "m-vllm"])
async def test_a_policy_that_does_not_observe_completed_is_not_sent_it(cluster: Cluster, model: str) -> None:
    rec = RecordingPolicy(cluster.gateway.orchestrator.policy, (Routed, Failed, WorkerGone))
    cluster.gateway.orchestrator.policy = rec
    await served(cluster, model)
    assert [type(e) for e in rec.events] == [Routed]


async def test_a_policy_that_names_no_events_is_sent_every_one(cluster: Cluster) -> None:
    rec = RecordingPolicy(cluster.gateway.orchestrator.policy, None)
    cluster.gateway.orchestrator.policy = rec
    await served(cluster, "m-sglang")
    assert [type(e) for e in rec.events] == [Routed, Completed]
    done = rec.events[1]
    assert isinstance(done, Completed) and done.worker_ids == ("sgl-p", "sgl-d") and done.legs


def test_round_robin_does_not_want_completed() -> None:
    policy = make_policy()
    assert wants(policy, Routed) and not wants(policy, Completed)
    assert wants(object(), Completed)  # nothing named: every event

    class Odd:
        def observes(self) -> bool:  # not a list of event types: every event
            return False

    assert wants(Odd(), Completed)
