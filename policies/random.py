"""`random`: each role picks a candidate at random, weighted by the worker's `weight`.

Algorithm: `rng.choices(candidates, weights=[w.weight ...])`; when every weight is zero or
negative the choice is uniform.

Parameters:
- `seed` (config) or `rng` (code): the source of randomness. Inject a seeded `random.Random`
  in tests for reproducible choices. Drawing from it is the policy's only side effect in
  `plan()`; it keeps no other state.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from policies.base import Profile
from policies.pd import PDPolicy
from policies.snapshot import RequestView, WorkerState


class RandomPicker:
    name = "random"

    def __init__(self, rng: _random.Random | None = None) -> None:
        self.rng = rng if rng is not None else _random.Random()

    def pick(self, req: RequestView, scored: Sequence[tuple[WorkerState, float]]) -> WorkerState:
        cands = [w for w, _ in scored]
        weights = [max(w.weight, 0.0) for w in cands]
        if sum(weights) <= 0.0:
            return self.rng.choice(cands)
        return self.rng.choices(cands, weights=weights)[0]


def random_profile(rng: _random.Random | None = None, name: str = "random") -> Profile:
    return Profile(name=name, picker=RandomPicker(rng))


def make_policy(rng: _random.Random | None = None, seed: int | None = None) -> PDPolicy:
    """A whole random policy; the roles share `rng` (or one seeded from `seed`)."""
    rng = rng if rng is not None else _random.Random(seed)
    return PDPolicy(
        "random", decode=random_profile(rng), prefill=random_profile(rng), colocated=random_profile(rng)
    )
