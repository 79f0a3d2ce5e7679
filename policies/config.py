"""Typed, strictly decoded policy configuration: one frozen Struct per policy, a tagged union.

In TOML a policy is a table whose `type` names it, or just its name as a string:

    policy = "least_load"
    policy = { type = "least_load", waiting_weight = 4.0 }
    prefill_policy = { type = "power_of_two", seed = 7 }
    decode_policy = { type = "plugin", name = "my-policy", options = { knob = 1 } }
    policy = "plugin:my-policy"          # a plugin without options

Unknown fields are errors (`forbid_unknown_fields`); `policies.build.build_policy` turns a
config into a `Policy` with an exhaustive `match`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import msgspec


class _Cfg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


class RoundRobinCfg(_Cfg, tag="round_robin", frozen=True):
    """`policies.round_robin`; no parameters."""


class RandomCfg(_Cfg, tag="random", frozen=True):
    """`policies.random`; `seed` None = seeded from the OS."""

    seed: int | None = None


class _LoadCfg(_Cfg, frozen=True):
    inflight_weight: float = 1.0
    inflight_tokens_weight: float = 0.001
    waiting_weight: float = 2.0
    running_weight: float = 0.5

    def __post_init__(self) -> None:
        for name in ("inflight_weight", "inflight_tokens_weight", "waiting_weight", "running_weight"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:  # nan passes `< 0`; inf makes every load nan
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")


class LeastLoadCfg(_LoadCfg, tag="least_load", frozen=True):
    """`policies.least_load`; the load weights."""


class PowerOfTwoCfg(_LoadCfg, tag="power_of_two", frozen=True):
    """`policies.power_of_two`; the load weights and an optional `seed`."""

    seed: int | None = None


class SessionAffinityCfg(_LoadCfg, tag="session_affinity", frozen=True):
    """`policies.session_affinity`: a session (`x-session-id`, body `session_id` or `user`) stays
    on its rendezvous-hashed worker while that worker's load stays within `load_factor` x the
    mean and its predicted prefill queue within `ttft_slo_s`; else, and without a session, the
    least loaded (the load weights)."""

    load_factor: float = 1.25  # consistent hashing with bounded loads: at most this x the mean
    ttft_slo_s: float = 2.0  # leave the home worker when its predicted queue is longer
    prefill_rate: float = 10_000.0  # tokens/s: in-flight tokens -> predicted queue seconds
    waiting_s: float = 0.5  # seconds per request the engine reports waiting

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.load_factor) and self.load_factor >= 1.0):
            raise ValueError(f"load_factor must be a finite number >= 1, got {self.load_factor}")
        for name in ("ttft_slo_s", "prefill_rate", "waiting_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")


class CacheAwareCfg(_Cfg, tag="cache_aware", frozen=True):
    """`policies.cache_aware`: the lowest predicted time to first token, from the prefix caches
    (docs/policies.md). The first five keys are sglang-router's / vllm-router's, same meaning."""

    # a match counts only when matched / prompt tokens exceeds this (sglang-router: 0.3)
    cache_threshold: float = 0.0
    # the chosen worker is replaced by the least loaded when it has more requests in flight than
    # the least loaded by more than balance_abs_threshold AND more than balance_rel_threshold x
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    # seconds between sweeps of stale state (requests whose outcome never came); the index
    # itself is trimmed as entries are added, so it never exceeds max_tree_size
    eviction_interval: float = 120.0
    # the approximate index's budget per model, in tokens (sglang-router: characters or tokens)
    max_tree_size: int = 1 << 24
    block_tokens: int = 16  # tokens per block of the approximate index (text: x chars_per_token bytes)
    chars_per_token: float = 4.0  # text prompts: bytes per token for the index's blocks
    # each worker's KV cache in tokens where the engine does not report it; None: no per-worker
    # bound (only max_tree_size)
    worker_cache_tokens: int | None = None
    prefill_rate: float = 10_000.0  # work/s a worker prefills, until measured (and learned)
    # prefill work counts attention: new x (1 + (cached + new / 2) / crossover_tokens) dense
    # tokens; params / (2 x layers x hidden): ~30,500 for Llama-3-8B, ~53,000 for 70B; 0: tokens
    crossover_tokens: float = 32_768.0
    # cost = queued wait + own prefill x (1 + inflight_factor x requests in flight): LMetric's
    # batch term at 1.0; 0: the predicted TTFT alone
    inflight_factor: float = 1.0
    # + queue_externality x (the delay a prefill's work adds to the requests arriving while the
    # pool is busy, policies/pool_pressure.py); 0: the predicted TTFT and batch term alone
    queue_externality: float = 1.0
    pressure_window_s: float = 10.0  # arrivals and work per second: decayed over this window
    # the pool wait W the externality reads: "mean", over the candidates; "shared", over those
    # later arrivals share, a worker too backed up to rejoin them left out (policies/pool_pressure.py)
    queue_wait: Literal["mean", "shared"] = "mean"
    # + evict_price x uncached / rate x (new KV tokens sent to the worker over evict_window_s,
    # decayed) / its KV pool: the price of the cached prefixes the new KV evicts where the cache
    # turns over fast (policies/turnover.py); 0: off. Needs the pool (reported, or worker_cache_tokens)
    evict_price: float = 0.0
    evict_window_s: float = 5.0  # the best measured (docs/benchmarks.md, "An eviction price")
    # + tail_price x max(0, predicted TTFT - tail_ttft_s): the request's own wait beyond the
    # threshold counts 1 + tail_price times, so a turn leaves a backed-up holder for a worker
    # predicted within it (policies/tail_price.py); 0: off
    tail_price: float = 0.0
    tail_ttft_s: float = 0.5
    saturation_wait_s: float = 10.0  # queued prefill beyond this: no new work while others have less
    max_candidates: int = 16  # deepest-matching workers considered in a large pool
    scan_limit: int = 64  # pools up to this size are scored whole
    sample: int = 4  # larger pools, `large_pool = "sample"`: random workers scored besides the matches
    # larger pools: "sample": the deepest matches plus `sample` random workers (may miss the
    # cheapest); "exact": the worker scoring them whole would choose (policies/cache_pool_order.py,
    # about 3.5x the decision time at 1,000 workers: docs/benchmarks.md)
    large_pool: Literal["exact", "sample"] = "sample"
    index: Literal["auto", "approximate"] = "auto"  # auto: the KV-event index where live and verified
    # when the approximate index counts a prompt as its worker's: "routed" (at once: requests
    # sharing a prefix in flight are drawn to one worker) or "prefilled" (when its predicted
    # prefill ends, as an engine registers blocks: the predictions match what engines report)
    record: Literal["routed", "prefilled"] = "routed"
    # when the precise (KV-event) index counts a prompt as its worker's: "routed" (at once, until
    # it ends or 120 s pass: a turn arriving while its predecessor prefills is drawn to that
    # worker; its token ids are compared with the pending prompts', docs/policies.md "Prompts
    # routed but not yet stored") or "stored" (the engines' events alone)
    precise_record: Literal["routed", "stored"] = "routed"
    # SLO-aware choice (policies/decode_slo.py): the fewest predicted SLO misses first (this
    # request's TTFT, the TPOT of the decodes its prefill would stall), then the lowest cost.
    # TTFT SLO = ttft_slo_s + ttft_slo_x x the prompt's prefill on an idle worker; TPOT SLO =
    # tpot_slo_s + tpot_slo_x x the worker's best time per token; all 0 (default): off
    ttft_slo_s: float = 0.0
    ttft_slo_x: float = 0.0
    tpot_slo_s: float = 0.0
    tpot_slo_x: float = 0.0
    # what the SLO term counts as cached when it predicts a prefill's seconds on a worker:
    # "routed" (the index, as the cost does) or "prefilled" (not a prefix a prefill still running
    # there writes: the engine computes it again; policies/decode_slo.py)
    slo_cache: Literal["routed", "prefilled"] = "routed"
    # the SLO term's unloaded time per token of a worker with under 10 streams of its own: "worker"
    # (the median of its streams) or "pool" (the least of the pool's, once it has 10)
    slo_best: Literal["worker", "pool"] = "worker"
    # how a worker's prefill rate is learned from what requests took: "rate" (an average of
    # work / seconds) or "line" (seconds = fixed cost + work / rate, fitted per worker: a small
    # prefill's fixed cost is not taken for a slow rate; policies/prefill_cost.py)
    prefill_fit: Literal["rate", "line"] = "rate"
    # the prefill work a routed request adds to its worker's queue: "routed" (the index's cached
    # tokens, as the cost counts them) or "prefilled" (the engine's view, as `slo_cache =
    # "prefilled"` counts it: a turn sent while its predecessor still prefills there queues its
    # whole prompt); "prefilled" needs slo_cache = "prefilled"
    queue_cache: Literal["routed", "prefilled"] = "routed"
    # how the request's own TTFT SLO (ttft_slo_s / ttft_slo_x) counts: "sum" (one more miss, as a
    # decode broken is) or "after_tpot" (the fewest decodes broken first, then within its own
    # TTFT SLO, then the cost; policies/decode_slo.py `ttft_rank`)
    ttft_slo_rank: Literal["sum", "after_tpot"] = "sum"
    # > 0 (needs an SLO): the cache holder of a turn (holding >= turn_keep_share of its prompt)
    # stays among the candidates beside the fewest SLO misses where the cheapest of those costs
    # >= turn_keep_x x (its extra misses) x the holder's cost (policies/turn_keep.py); 0: off
    turn_keep_x: float = 0.0
    turn_keep_share: float = 0.5
    seed: int | None = None
    # when the approximate index counts a colocated prompt as used: "routed" (as it is sent) or
    # "done" (also as its answer ends: an engine frees a request's blocks into its LRU then, so
    # a prefix is as recent there as its last answer's end, not its routing; policies/cache_state.py)
    lru_touch: Literal["routed", "done"] = "done"
    # seconds: the gateway holds a colocated turn whose prefix a prefill still running on its
    # worker writes until that prefill's predicted end, at most this long (then it finds the
    # prefix, where sent at once it would compute it again; policies/inflight.py); 0: off
    inflight_hold: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError("balance_abs_threshold must be >= 0")
        if not (math.isfinite(self.balance_rel_threshold) and self.balance_rel_threshold >= 1.0):
            raise ValueError("balance_rel_threshold must be a finite number >= 1")
        if self.queue_cache == "prefilled" and self.slo_cache != "prefilled":
            raise ValueError('queue_cache = "prefilled" needs slo_cache = "prefilled"')
        for name in ("eviction_interval", "chars_per_token", "prefill_rate", "saturation_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.inflight_hold) and self.inflight_hold >= 0):
            raise ValueError(f"inflight_hold must be a finite number >= 0, got {self.inflight_hold}")
        for name in ("max_tree_size", "block_tokens", "max_candidates", "scan_limit", "sample"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not (math.isfinite(self.queue_externality) and self.queue_externality >= 0):
            raise ValueError(f"queue_externality must be a finite number >= 0, got {self.queue_externality}")
        if self.large_pool == "exact" and self.queue_externality > 0:
            raise ValueError(
                'large_pool = "exact" needs queue_externality = 0: the busy-pool price is taken over the whole pool, which the exact search does not read'
            )
        if not (math.isfinite(self.evict_price) and self.evict_price >= 0):
            raise ValueError(f"evict_price must be a finite number >= 0, got {self.evict_price}")
        if not (math.isfinite(self.evict_window_s) and self.evict_window_s > 0):
            raise ValueError(f"evict_window_s must be a finite number > 0, got {self.evict_window_s}")
        if self.large_pool == "exact" and self.evict_price > 0:
            raise ValueError(
                'large_pool = "exact" needs evict_price = 0: the exact search does not price evictions'
            )
        for name in ("tail_price", "tail_ttft_s"):
            if not (math.isfinite(value := getattr(self, name)) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.large_pool == "exact" and self.tail_price > 0:
            raise ValueError(
                'large_pool = "exact" needs tail_price = 0: the exact search does not price the tail'
            )
        if not (math.isfinite(self.pressure_window_s) and self.pressure_window_s > 0):
            raise ValueError(f"pressure_window_s must be a finite number > 0, got {self.pressure_window_s}")
        if not (math.isfinite(self.inflight_factor) and self.inflight_factor >= 0):
            raise ValueError(f"inflight_factor must be a finite number >= 0, got {self.inflight_factor}")
        if not (math.isfinite(self.crossover_tokens) and self.crossover_tokens >= 0):
            raise ValueError(f"crossover_tokens must be a finite number >= 0, got {self.crossover_tokens}")
        if self.worker_cache_tokens is not None and self.worker_cache_tokens < 1:
            raise ValueError("worker_cache_tokens must be >= 1")
        for name in ("ttft_slo_s", "ttft_slo_x", "tpot_slo_s", "tpot_slo_x"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        slo = self.ttft_slo_s + self.ttft_slo_x + self.tpot_slo_s + self.tpot_slo_x
        self._check_turn_keep(slo)
        if self.large_pool == "exact" and slo > 0:
            raise ValueError('large_pool = "exact" does not weigh SLOs: set no ttft_slo_* / tpot_slo_*')

    def _check_turn_keep(self, slo: float) -> None:
        """`turn_keep_x` 0 or >= 1, `turn_keep_share` in (0, 1], the first only with an SLO."""
        if not (math.isfinite(self.turn_keep_x) and (self.turn_keep_x == 0 or self.turn_keep_x >= 1)):
            raise ValueError(f"turn_keep_x must be 0 (off) or a finite number >= 1, got {self.turn_keep_x}")
        if not 0.0 < self.turn_keep_share <= 1.0:
            raise ValueError(f"turn_keep_share must be in (0, 1], got {self.turn_keep_share}")
        if self.turn_keep_x > 0 and slo <= 0:
            raise ValueError(
                "turn_keep_x needs an SLO (ttft_slo_* or tpot_slo_*): it keeps turns the SLO rank drops"
            )


class PluginCfg(_Cfg, tag="plugin", frozen=True):
    """A policy from the `pd_gateway.policies` entry point group; `options` go to its factory."""

    name: str
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("plugin name must not be empty")


PolicyCfg = (
    RoundRobinCfg | RandomCfg | LeastLoadCfg | PowerOfTwoCfg | SessionAffinityCfg | CacheAwareCfg | PluginCfg
)

BUILTIN_POLICY_NAMES: tuple[str, ...] = (
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "session_affinity",
    "cache_aware",
)


class DeciderCfg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The disaggregation decider (policies/decider.py; docs/policies.md, "Deciders").

    `type`: "threshold" (P/D when `prompt_tokens - cached >= min_prefill_tokens`; 0, the
    default, always disaggregates when a P/D pool serves the model), "always", "never", or
    "cost_model" (predicted TTFT and decode slowdown of each alternative, under the SLOs below).
    A table without `type` that sets `min_prefill_tokens` is a threshold, as before.
    """

    type: Literal["threshold", "always", "never", "cost_model"] = "threshold"
    min_prefill_tokens: int = 0
    # cost_model: the SLOs a request is held to (seconds; `_x`: a multiple of the request's own
    # unloaded figure, added to the seconds)
    ttft_slo_s: float = 2.0
    ttft_slo_x: float = 0.0
    tpot_slo_s: float = 0.1
    tpot_slo_x: float = 0.0
    roomy: float = 0.0  # P/D whenever its predicted TTFT is within this share of the TTFT SLO (0: off)
    local_penalty: float = 0.2  # a local or colocated prefill's cost is its TTFT x (1 + this)
    tpot_risk: float = 0.0  # share of the decodes running there that may be predicted over the TPOT SLO
    joint: bool = True  # choose the P/D pair jointly (transfer cost, pair failures)
    pair_candidates: int = 4  # decodes weighed for the pair (the decode policy's pick first)
    pair_slack: int = 2  # ... those with at most this many more requests in flight
    max_candidates: int = 16  # prefill / colocated workers scored per decode (the least loaded)
    # the priors, until outcomes are learned
    prefill_rate: float = 10_000.0  # tokens/s
    prefill_overhead_s: float = 0.02
    transfer_s_per_token: float = 5e-6
    transfer_overhead_s: float = 0.01
    tpot_s: float = 0.02
    crossover_tokens: float = 32_768.0  # where attention costs as much as the dense part (0: tokens)
    chunk_tokens: int = 8192  # the engines' prefill tokens per step
    forget: float = 0.05  # the fits' forgetting per outcome (a window of about 1/forget outcomes)

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise ValueError("min_prefill_tokens must be >= 0")
        for name in (
            "ttft_slo_s",
            "ttft_slo_x",
            "tpot_slo_s",
            "tpot_slo_x",
            "roomy",
            "local_penalty",
            "tpot_risk",
            "transfer_s_per_token",
            "transfer_overhead_s",
            "prefill_overhead_s",
            "crossover_tokens",
        ):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("prefill_rate", "tpot_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not 0 < self.forget < 1:
            raise ValueError(f"forget must be in (0, 1), got {self.forget}")
        if self.tpot_risk > 1:
            raise ValueError("tpot_risk must be in [0, 1]")
        for name in ("pair_candidates", "max_candidates", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.pair_slack < 0:
            raise ValueError("pair_slack must be >= 0")


def policy_shorthand(value: str) -> dict[str, object]:
    """`"least_load"` -> `{"type": "least_load"}`; `"plugin:NAME"` -> `{"type": "plugin", "name": NAME}`."""
    if value.startswith("plugin:"):
        return {"type": "plugin", "name": value.removeprefix("plugin:")}
    return {"type": value}


def parse_policy(value: str | Mapping[str, object]) -> PolicyCfg:
    """A policy config from its string shorthand or a table; raises `msgspec.ValidationError`."""
    raw = policy_shorthand(value) if isinstance(value, str) else dict(value)
    return msgspec.convert(raw, PolicyCfg)
