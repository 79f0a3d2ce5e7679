"""`power_of_two`: each role samples two distinct candidates at random and takes the less loaded.

Algorithm ("the power of two choices"): with one candidate, take it; otherwise draw two
without replacement and keep the one with the higher `LoadScorer` score (ties: the first
drawn). Cheaper to keep fresh than a global minimum and avoids the herd effect of
`least_load` when snapshots lag behind.

Parameters: the load weights of `least_load` (`LoadWeights`, same defaults) and `seed` (config)
or `rng` (code), the source of randomness, injectable for reproducible tests.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from policies.base import Profile
from policies.least_load import LoadScorer, LoadWeights
from policies.pd import PDPolicy
from policies.snapshot import RequestView, WorkerState


class PowerOfTwoPicker:
    name = "power_of_two"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self.rng = rng if rng is not None else _random.Random()

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        if len(scored) == 1:
            return scored[0][0]
        (a, sa), (b, sb) = self.rng.sample(list(scored), 2)
        return a if sa >= sb else b


def power_of_two_profile(
    weights: LoadWeights | None = None, rng: _random.Random | None = None, name: str = "power_of_two"
) -> Profile:
    return Profile(name=name, picker=PowerOfTwoPicker(rng), scorers=((LoadScorer(weights), 1.0),))


def make_policy(
    weights: LoadWeights | None = None, rng: _random.Random | None = None, seed: int | None = None
) -> PDPolicy:
    """A whole power-of-two policy; the roles share `rng` (or one seeded from `seed`)."""
    rng = rng if rng is not None else _random.Random(seed)
    return PDPolicy(
        "power_of_two",
        decode=power_of_two_profile(weights, rng),
        prefill=power_of_two_profile(weights, rng),
        colocated=power_of_two_profile(weights, rng),
    )
