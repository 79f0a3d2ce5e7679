"""Online estimators the cost model learns with (policies/cost_model.py): an exponentially
weighted least-squares line (`LinearFit`), an EWMA with a floor (`Ewma`), and the prefill work
of a prompt part (`prefill_work`, its formula in cost_model's docstring)."""

from __future__ import annotations

import math

# the priors' weight in a fit, in outcomes: a few real ones outweigh them
PRIOR_WEIGHT = 0.5


def prefill_work(new: float, cached: float, crossover: float) -> float:
    """Token-equivalents of prefilling `new` tokens after `cached` ones (module docstring)."""
    if new <= 0:
        return 0.0
    if crossover <= 0:
        return float(new)
    return new * (1.0 + (cached + new / 2.0) / crossover)


class LinearFit:
    """`y = a + b * x`, fitted online by exponentially weighted least squares.

    Starts from a prior line (two pseudo-observations at x = 0 and x = `x_ref`, of weight
    `prior_weight` each) that fades as samples come: every sample first scales the sums by
    `1 - forget`, so the fit follows a worker whose speed changes (a window of about
    `1 / forget` samples). `b` stays within [`b_min`, `b_max`] and `a` within [0, `a_max`];
    samples whose x are all alike fix `a` and fit `b` alone."""

    __slots__ = ("_a0", "_s0", "_s1", "_s2", "_t1", "_t2", "a_max", "b_max", "b_min", "forget", "samples")

    def __init__(
        self,
        a0: float,
        b0: float,
        x_ref: float,
        *,
        prior_weight: float = 2.0,
        forget: float = 0.05,
        b_min: float = 1e-12,
        b_max: float = 1.0,
        a_max: float = 60.0,
    ) -> None:
        self.forget = forget
        self.b_min, self.b_max, self.a_max = b_min, b_max, a_max
        self._a0 = a0
        w = prior_weight
        y_ref = a0 + b0 * x_ref
        self._s0 = 2 * w  # sum of weights
        self._s1 = w * x_ref  # sum w x
        self._s2 = w * x_ref * x_ref  # sum w x^2
        self._t1 = w * (a0 + y_ref)  # sum w y
        self._t2 = w * x_ref * y_ref  # sum w x y
        self.samples = 0

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            return
        k = 1.0 - self.forget
        self._s0 = self._s0 * k + 1.0
        self._s1 = self._s1 * k + x
        self._s2 = self._s2 * k + x * x
        self._t1 = self._t1 * k + y
        self._t2 = self._t2 * k + x * y
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b)."""
        s0, s1, s2, t1, t2 = self._s0, self._s1, self._s2, self._t1, self._t2
        det = s0 * s2 - s1 * s1
        if det > 1e-9 * max(1.0, s0 * s2):
            b = (s0 * t2 - s1 * t1) / det
            a = (t1 - b * s1) / s0
        else:  # x all alike: keep the prior's overhead, fit the slope
            a = self._a0
            b = (t2 - a * s1) / s2 if s2 > 0 else self.b_min
        if a < 0.0:  # through the origin
            a = 0.0
            b = t2 / s2 if s2 > 0 else b
        b = min(max(b, self.b_min), self.b_max)
        a = min(max(a, 0.0), self.a_max)
        return a, b

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * x


class Ewma:
    """An exponentially weighted mean from a prior, and a floor that falls at once and rises
    slowly (an "unloaded" reference: the best the worker did lately)."""

    __slots__ = ("floor", "mean", "samples", "weight")

    def __init__(self, prior: float, weight: float = 0.1) -> None:
        self.mean = prior
        self.floor = prior
        self.weight = weight
        self.samples = 0

    def add(self, x: float) -> None:
        if not math.isfinite(x) or x < 0:
            return
        if self.samples == 0:
            self.mean = self.floor = x
        else:
            self.mean += self.weight * (x - self.mean)
            self.floor = x if x < self.floor else self.floor + 0.01 * (x - self.floor)
        self.samples += 1
