"""Which requests a sampled check picks: a countdown to the next pick, drawn from a geometric
distribution, so that each request is picked with probability `fraction`, independently, as
with a coin flip per request, while an unpicked request costs one decrement and one comparison
(no RNG call on the hot path)."""

from __future__ import annotations

import math
import random

_NEVER = 1 << 62


class ShareSampler:
    """Picks a `fraction` share of the requests it is asked about (`due`)."""

    __slots__ = ("_log_miss", "fraction", "left", "rng")

    def __init__(self, fraction: float, rng: random.Random) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError("fraction must be in [0, 1]")
        self.fraction = fraction
        self.rng = rng
        self._log_miss = math.log1p(-fraction) if 0.0 < fraction < 1.0 else 0.0
        self.left = self._gap()

    def _gap(self) -> int:
        """Requests until the next pick, this one counted: 1 + Geometric(fraction) failures."""
        f = self.fraction
        if f >= 1.0:
            return 1
        if f <= 0.0:
            return _NEVER
        u = self.rng.random()  # in [0, 1): 1 - u in (0, 1]
        return 1 + int(math.log(1.0 - u) / self._log_miss)

    def due(self) -> bool:
        """Is this request picked?"""
        self.left -= 1
        if self.left > 0:
            return False
        self.left = self._gap()
        return True
