"""Per-request records and what is computed from them: percentiles, SLOs, goodput.

A request *meets its SLOs* when it succeeded, its TTFT is within the TTFT SLO and its TPOT
(time per output token after the first) within the TPOT SLO; a request with one output token
has no TPOT and meets that SLO. An SLO is absolute (seconds) or relative: a multiple of the
request's own unloaded TTFT/TPOT, from a calibration pass (`Calibration`). Goodput is the
requests that met both SLOs per second of the run; attainment is their share of all the
requests the run sent (errors and unfinished requests included, so they count against it).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

import msgspec

from bench.loadgen import percentile

QUANTILES = (50.0, 90.0, 99.0)


class Record(msgspec.Struct, kw_only=True):
    """One request of a run (times in seconds on the client's monotonic clock)."""

    index: int  # row index in the replayed slice
    input_length: int
    output_length: int
    scheduled: float = 0.0  # when it was due
    sent: float = 0.0  # when its first byte was written
    first_token: float = 0.0  # first output token arrived (0: none)
    last_token: float = 0.0
    done: float = 0.0  # answer complete (0: not)
    status: int = 0  # HTTP status (0: none)
    completion_tokens: int = 0
    prompt_tokens: int = -1  # as the engine reported it (-1: not reported)
    cached_tokens: int = -1  # of the prompt, as the engine reported it (-1: no usage came)
    error: str = ""
    warmup: bool = False  # sent, but left out of the statistics

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.done > 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent if self.first_token else math.nan

    @property
    def tpot(self) -> float:
        if self.completion_tokens <= 1 or not self.first_token:
            return math.nan
        return (self.last_token - self.first_token) / (self.completion_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.done - self.sent if self.done else math.nan

    @property
    def send_lag(self) -> float:
        return self.sent - self.scheduled if self.sent else math.nan


class Slo(msgspec.Struct, frozen=True):
    """`value` seconds, or `value` x the request's unloaded figure when `relative`."""

    value: float
    relative: bool = False

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'2.5' (seconds), '250ms', or '5x' (relative to the unloaded figure)."""
        t = text.strip().lower()
        try:
            if t.endswith("x"):
                return cls(float(t[:-1]), True)
            if t.endswith("ms"):
                return cls(float(t[:-2]) / 1000.0)
            return cls(float(t.removesuffix("s")))
        except ValueError:
            raise ValueError(f"bad SLO {text!r}: seconds ('2.5', '250ms') or a multiple ('5x')") from None

    def limit(self, unloaded: float) -> float:
        return self.value * unloaded if self.relative else self.value

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}s"


class Calibration(msgspec.Struct):
    """Unloaded TTFT and TPOT measured at a few prompt lengths, one request at a time on an
    idle cluster with nothing cached; read in between by linear interpolation (and flat beyond
    the ends)."""

    lengths: list[int]
    ttft_s: list[float]
    tpot_s: list[float]

    def _interp(self, ys: Sequence[float], length: int) -> float:
        xs = self.lengths
        if not xs:
            return math.nan
        if length <= xs[0]:
            return ys[0]
        if length >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, length)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (length - x0) / (x1 - x0)

    def ttft(self, length: int) -> float:
        return self._interp(self.ttft_s, length)

    def tpot(self, length: int) -> float:
        return self._interp(self.tpot_s, length)


def meets(rec: Record, ttft_slo: Slo, tpot_slo: Slo, calib: Calibration | None) -> tuple[bool, bool]:
    """(TTFT met, TPOT met) for one request; a failed request meets neither."""
    if not rec.ok:
        return False, False
    if (ttft_slo.relative or tpot_slo.relative) and calib is None:
        raise ValueError("a relative SLO needs a calibration")
    t_lim = ttft_slo.limit(calib.ttft(rec.input_length) if calib else 0.0)
    p_lim = tpot_slo.limit(calib.tpot(rec.input_length) if calib else 0.0)
    ttft_ok = rec.ttft <= t_lim
    tpot = rec.tpot
    tpot_ok = math.isnan(tpot) or tpot <= p_lim
    return ttft_ok, tpot_ok


class Summary(msgspec.Struct, kw_only=True):
    requests: int  # measured (warm-up excluded)
    completed: int
    errors: int
    unfinished: int  # sent but neither answered nor failed when the run ended
    duration_s: float
    throughput_rps: float
    output_tps: float
    goodput_rps: float
    slo_attainment: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_s: dict[str, float]
    tpot_s: dict[str, float]
    e2e_s: dict[str, float]
    send_lag_s: dict[str, float]
    prompt_mismatches: int  # the engine's prompt_tokens differ from the row's length
    prompt_unreported: int
    error_samples: list[str]


def pcts(values: Iterable[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    out = {f"p{q:g}": percentile(vals, q) for q in QUANTILES}
    out["mean"] = sum(vals) / len(vals) if vals else math.nan
    out["max"] = max(vals) if vals else math.nan
    return out


def summarize(records: Sequence[Record], ttft_slo: Slo, tpot_slo: Slo, calib: Calibration | None) -> Summary:
    measured = [r for r in records if not r.warmup and r.sent]
    ok = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok and (r.error or r.status not in (0, 200))]
    unfinished = len(measured) - len(ok) - len(failed)
    start = min((r.sent for r in measured), default=0.0)
    end = max((r.done for r in ok), default=start)
    duration = max(end - start, 1e-9) if ok else 0.0
    met_t = met_p = met_both = 0
    for r in measured:
        t_ok, p_ok = meets(r, ttft_slo, tpot_slo, calib)
        met_t += t_ok
        met_p += p_ok
        met_both += t_ok and p_ok
    n = len(measured)
    samples: list[str] = []
    for r in failed:
        msg = r.error or f"HTTP {r.status}"
        if msg not in samples:
            samples.append(msg)
        if len(samples) >= 5:
            break
    mismatches = sum(1 for r in ok if r.prompt_tokens >= 0 and r.prompt_tokens != r.input_length)
    return Summary(
        requests=n,
        completed=len(ok),
        errors=len(failed),
        unfinished=unfinished,
        duration_s=duration,
        throughput_rps=len(ok) / duration if duration else 0.0,
        output_tps=sum(r.completion_tokens for r in ok) / duration if duration else 0.0,
        goodput_rps=met_both / duration if duration else 0.0,
        slo_attainment=met_both / n if n else math.nan,
        ttft_attainment=met_t / n if n else math.nan,
        tpot_attainment=met_p / n if n else math.nan,
        ttft_s=pcts(r.ttft for r in ok),
        tpot_s=pcts(r.tpot for r in ok),
        e2e_s=pcts(r.e2e for r in ok),
        send_lag_s=pcts(r.send_lag for r in measured),
        prompt_mismatches=mismatches,
        prompt_unreported=sum(1 for r in ok if r.prompt_tokens < 0),
        error_samples=samples,
    )
