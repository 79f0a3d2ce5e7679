"""The sampled check's picker: each request picked with probability `fraction`, independently
(a geometric countdown instead of a coin flip per request)."""

from __future__ import annotations

import itertools
import random

import pytest

from gateway.config import GatewayConfig, GuardsConfig
from gateway.metrics import GatewayMetrics
from gateway.orchestration import Orchestrator
from gateway.orchestration.sampling import ShareSampler
from gateway.registry import Registry
from policies.build import build_policy
from policies.config import RoundRobinCfg


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.5])
def test_the_share_picked_and_the_gaps_between_picks_are_a_coin_flips(fraction: float) -> None:
    sampler = ShareSampler(fraction, random.Random(7))
    n = 200_000
    picks = [i for i in range(n) if sampler.due()]
    mean = n * fraction
    assert abs(len(picks) - mean) < 5 * (mean * (1 - fraction)) ** 0.5  # within 5 sigma
    gaps = [b - a for a, b in itertools.pairwise(picks)]
    # geometric: P(gap > k) = (1 - f)^k; checked at the gap's mean
    k = round(1 / fraction)
    share_longer = sum(g > k for g in gaps) / len(gaps)
    assert abs(share_longer - (1 - fraction) ** k) < 0.03


def test_none_and_all() -> None:
    never, always = ShareSampler(0.0, random.Random(1)), ShareSampler(1.0, random.Random(1))
    assert not any(never.due() for _ in range(10_000))
    assert all(always.due() for _ in range(10_000))
    with pytest.raises(ValueError):
        ShareSampler(1.5, random.Random(1))


def _picks(cfg: GatewayConfig, n: int = 400) -> list[int]:
    orch = Orchestrator(Registry(), build_policy(RoundRobinCfg()), GatewayMetrics(), cfg)
    return [i for i in range(n) if orch.s.verify_share.due()]


def test_the_gateways_sample_follows_guards_shadow_seed() -> None:
    # the same seed: the same answers picked in every process and run; another seed: others
    same = _picks(GatewayConfig()), _picks(GatewayConfig())
    assert same[0] == same[1] and same[0][0] == 36  # the 37th eligible answer first (docs/guards.md)
    other = _picks(GatewayConfig(guards=GuardsConfig(shadow_seed=1)))
    assert other and other != same[0]
