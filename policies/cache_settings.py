"""The `cache_aware` policy's settings, as built from its configuration (policies/build.py);
policies/config.py `CacheAwareCfg` documents each knob."""

from __future__ import annotations

from dataclasses import dataclass, field

from policies.decode_slo import SloSettings


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    """The knobs (`policies.config.CacheAwareCfg` documents each)."""

    cache_threshold: float = 0.0
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 1 << 24
    block_tokens: int = 16
    chars_per_token: float = 4.0
    worker_cache_tokens: int | None = None
    prefill_rate: float = 10_000.0
    crossover_tokens: float = 32_768.0
    inflight_factor: float = 1.0
    queue_externality: float = 1.0
    pressure_window_s: float = 10.0
    shared_wait: bool = False  # queue_wait = "shared" (policies/pool_pressure.py `shared_wait`)
    evict_price: float = 0.0  # the eviction price's weight (policies/turnover.py); 0: off
    evict_window_s: float = 5.0  # new KV sent to each worker: decayed over this window
    tail_price: float = 0.0  # the tail price's weight (policies/tail_price.py); 0: off
    tail_ttft_s: float = 0.5  # the predicted TTFT beyond which it counts
    saturation_wait_s: float = 10.0
    max_candidates: int = 16
    scan_limit: int = 64
    sample: int = 4
    exact_large_pool: bool = False
    use_kv_events: bool = True
    precise_pending: bool = True  # the precise index counts routed prompts until they end (PendingSink)
    record_prefilled: bool = False
    max_pending: int = 100_000
    slo: SloSettings = field(default_factory=SloSettings)  # off unless an SLO is set (policies/decode_slo.py)
    prefill_fit_line: bool = False  # the rate: a fitted line's slope (policies/prefill_cost.py `fit`)
    touch_done: bool = True  # a colocated prompt is touched in the index again as it ends
    inflight_hold_s: float = 0.0  # longest hold behind a running prefill (policies/inflight.py)

    def __post_init__(self) -> None:
        if self.exact_large_pool and self.queue_externality > 0:
            raise ValueError(
                'large_pool = "exact" needs queue_externality = 0: the busy-pool price is taken over the whole pool, which the exact search does not read'
            )
        if self.exact_large_pool and self.evict_price > 0:
            raise ValueError(
                'large_pool = "exact" needs evict_price = 0: the exact search does not price evictions'
            )
        if self.exact_large_pool and self.tail_price > 0:
            raise ValueError(
                'large_pool = "exact" needs tail_price = 0: the exact search does not price the tail'
            )
        if self.exact_large_pool and self.slo.on:
            raise ValueError('large_pool = "exact" does not weigh SLOs: set no ttft_slo_* / tpot_slo_*')
