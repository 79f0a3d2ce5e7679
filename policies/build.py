"""Build a `Policy` from its config: one exhaustive `match` over the closed set of policy types.

`build_policy(cfg)` with one config gives every role the same policy. `prefill` / `decode`
override the policy for those roles (`--prefill-policy`, `--decode-policy`); the colocated
pool always uses `cfg`. A plugin given alone owns the whole plan; a plugin combined with
other role policies must also implement `RoleSelector` (`select` + `observe`).
"""

from __future__ import annotations

import random as _random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import assert_never

from policies.base import (
    CacheEstimator,
    Decider,
    NonCachedTokensDecider,
    Policy,
    Profile,
    RoleSelector,
    Routed,
)
from policies.cache_aware import CacheAwareSelector, CacheAwareSettings, CacheState, LoadSelector
from policies.config import (
    CacheAwareCfg,
    DeciderCfg,
    LeastLoadCfg,
    PluginCfg,
    PolicyCfg,
    PowerOfTwoCfg,
    RandomCfg,
    RoundRobinCfg,
    SessionAffinityCfg,
    _LoadCfg,
)
from policies.cost_model import CostPriors
from policies.decider import AlwaysDecider, CostModelDecider, CostSettings, NeverDecider, PlanDecider
from policies.decode_slo import SloSettings
from policies.least_load import LoadWeights, least_load_profile
from policies.pd import PDPolicy
from policies.plugins import PluginError, PolicyFactory, load_plugin, make_plugin_policy
from policies.power_of_two import power_of_two_profile
from policies.prefix_source import PrefixSource
from policies.random import random_profile
from policies.round_robin import RoundRobinPicker, round_robin_profile
from policies.session_affinity import SessionAffinityPicker, session_affinity_profile
from policies.snapshot import Role
from policies.turn_keep import TurnKeep


class PolicyBuildError(Exception):
    """A policy config cannot be built (a plugin that cannot serve a single role, a load error)."""


def _weights(cfg: _LoadCfg) -> LoadWeights:
    return LoadWeights(
        inflight_weight=cfg.inflight_weight,
        inflight_tokens_weight=cfg.inflight_tokens_weight,
        waiting_weight=cfg.waiting_weight,
        running_weight=cfg.running_weight,
    )


def _rng(seed: int | None, role: str) -> _random.Random:
    # one stream per role so that adding a prefill draw never shifts the decode choices
    return _random.Random(None if seed is None else f"{seed}:{role}")


@dataclass
class BuildContext:
    """What the selectors of one policy share: the precise prefix index the gateway maintains
    from the engines' KV events (None: approximate only), the clock, and each `cache_aware`
    config's state (one per config, shared by the roles that use it)."""

    precise: PrefixSource | None = None
    clock: Callable[[], float] = time.monotonic
    states: dict[CacheAwareCfg, CacheState] = field(default_factory=dict)
    owners: set[CacheAwareCfg] = field(default_factory=set)
    # the one round-robin picker of the roles that use round robin: its cursors are per role,
    # and a `Routed` event reaches it once, not once per role (one call per request, not three)
    round_robin: RoundRobinPicker | None = None

    def state(self, cfg: CacheAwareCfg) -> CacheState:
        st = self.states.get(cfg)
        if st is None:
            st = self.states[cfg] = CacheState(
                cache_aware_settings(cfg), precise=self.precise, clock=self.clock
            )
        return st


def cache_aware_settings(cfg: CacheAwareCfg) -> CacheAwareSettings:
    return CacheAwareSettings(
        cache_threshold=cfg.cache_threshold,
        balance_abs_threshold=cfg.balance_abs_threshold,
        balance_rel_threshold=cfg.balance_rel_threshold,
        eviction_interval_s=cfg.eviction_interval,
        max_tree_size=cfg.max_tree_size,
        block_tokens=cfg.block_tokens,
        chars_per_token=cfg.chars_per_token,
        worker_cache_tokens=cfg.worker_cache_tokens,
        prefill_rate=cfg.prefill_rate,
        crossover_tokens=cfg.crossover_tokens,
        inflight_factor=cfg.inflight_factor,
        queue_externality=cfg.queue_externality,
        pressure_window_s=cfg.pressure_window_s,
        shared_wait=cfg.queue_wait == "shared",
        evict_price=cfg.evict_price,
        evict_window_s=cfg.evict_window_s,
        tail_price=cfg.tail_price,
        tail_ttft_s=cfg.tail_ttft_s,
        saturation_wait_s=cfg.saturation_wait_s,
        max_candidates=cfg.max_candidates,
        scan_limit=cfg.scan_limit,
        sample=cfg.sample,
        exact_large_pool=cfg.large_pool == "exact",
        use_kv_events=cfg.index == "auto",
        precise_pending=cfg.precise_record == "routed",
        record_prefilled=cfg.record == "prefilled",
        slo=SloSettings(
            cfg.ttft_slo_s,
            cfg.ttft_slo_x,
            cfg.tpot_slo_s,
            cfg.tpot_slo_x,
            prefilled=cfg.slo_cache == "prefilled",
            pool_best=cfg.slo_best == "pool",
            queue_prefilled=cfg.queue_cache == "prefilled",
            ttft_after_tpot=cfg.ttft_slo_rank == "after_tpot",
            keep=TurnKeep(cfg.turn_keep_x, cfg.turn_keep_share),
        ),
        prefill_fit_line=cfg.prefill_fit == "line",
        touch_done=cfg.lru_touch == "done",
        inflight_hold_s=cfg.inflight_hold,
    )


def build_selector(
    cfg: PolicyCfg,
    role: str,
    *,
    loader: Callable[[str], PolicyFactory] = load_plugin,
    context: BuildContext | None = None,
) -> RoleSelector:
    """The selector for one role ("prefill", "decode" or "colocated")."""
    match cfg:
        case RoundRobinCfg():
            if context is None:
                return round_robin_profile(f"round_robin/{role}", Role(role))
            if context.round_robin is None:
                context.round_robin = RoundRobinPicker()
            return Profile(name=f"round_robin/{role}", picker=context.round_robin)
        case RandomCfg():
            return random_profile(_rng(cfg.seed, role), f"random/{role}")
        case LeastLoadCfg():
            return least_load_profile(_weights(cfg), f"least_load/{role}")
        case PowerOfTwoCfg():
            return power_of_two_profile(_weights(cfg), _rng(cfg.seed, role), f"power_of_two/{role}")
        case SessionAffinityCfg():
            picker = SessionAffinityPicker(cfg.load_factor, cfg.ttft_slo_s, cfg.prefill_rate, cfg.waiting_s)
            return session_affinity_profile(picker, _weights(cfg), f"session_affinity/{role}")
        case CacheAwareCfg():
            ctx = context if context is not None else BuildContext()
            state = ctx.state(cfg)
            if role == "decode":  # a decode's cache saves no prefill work: load alone
                return LoadSelector(f"cache_aware/{role}", state.settings, rng=_rng(cfg.seed, role))
            owner = cfg not in ctx.owners  # one selector per state forwards the events to it
            ctx.owners.add(cfg)
            return CacheAwareSelector(f"cache_aware/{role}", state, rng=_rng(cfg.seed, role), owner=owner)
        case PluginCfg():
            policy = _plugin(cfg, loader)
            if not isinstance(policy, RoleSelector):
                raise PolicyBuildError(
                    f"policy plugin {cfg.name!r} cannot be combined with other role policies: "
                    "it does not implement select()/observe() (RoleSelector)"
                )
            return policy
        case _:
            assert_never(cfg)


def _plugin(cfg: PluginCfg, loader: Callable[[str], PolicyFactory]) -> Policy:
    try:
        return make_plugin_policy(cfg.name, dict(cfg.options), loader)
    except PluginError as e:
        raise PolicyBuildError(str(e)) from e


def _label(cfg: PolicyCfg) -> str:
    return f"plugin:{cfg.name}" if isinstance(cfg, PluginCfg) else cfg.__struct_config__.tag  # type: ignore[return-value]


def build_policy(
    cfg: PolicyCfg,
    *,
    prefill: PolicyCfg | None = None,
    decode: PolicyCfg | None = None,
    decider: DeciderCfg | None = None,
    loader: Callable[[str], PolicyFactory] = load_plugin,
    precise: PrefixSource | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Policy:
    """The gateway's policy. `precise`: the prefix index kept from the engines' KV events (for
    `cache_aware`). Raises `PolicyBuildError`."""
    decider = decider if decider is not None else DeciderCfg()
    prefill_cfg = prefill if prefill is not None else cfg
    decode_cfg = decode if decode is not None else cfg
    if isinstance(cfg, PluginCfg) and prefill_cfg == cfg and decode_cfg == cfg:
        return _plugin(cfg, loader)
    labels = [_label(cfg), _label(prefill_cfg), _label(decode_cfg)]
    name = labels[0] if len(set(labels)) == 1 else f"{labels[0]}(prefill={labels[1]},decode={labels[2]})"
    ctx = BuildContext(precise=precise, clock=clock)
    prefill_sel = build_selector(prefill_cfg, "prefill", loader=loader, context=ctx)
    colocated_sel = build_selector(cfg, "colocated", loader=loader, context=ctx)
    decode_sel = build_selector(decode_cfg, "decode", loader=loader, context=ctx)
    # the decider weighs the workers' caches where a cache_aware config keeps one (a threshold
    # of 0 always disaggregates: nothing to ask)
    state: CacheState | None = None
    for c in (cfg, prefill_cfg, decode_cfg):
        if isinstance(c, CacheAwareCfg):
            state = ctx.state(c)
            break
    asks = decider.type == "cost_model" or (decider.type == "threshold" and decider.min_prefill_tokens > 0)
    cache: CacheEstimator | None = state if asks else None
    return PDPolicy(
        name,
        decode=decode_sel,
        prefill=prefill_sel,
        colocated=colocated_sel,
        decider=build_decider(decider, state, clock),
        cache=cache,
    )


def build_decider(
    cfg: DeciderCfg, cache: CacheState | None = None, clock: Callable[[], float] = time.monotonic
) -> Decider | PlanDecider:
    """The decider of `[decider]` (`cache`: the cache-aware state whose index the cost model reads)."""
    match cfg.type:
        case "always":
            return AlwaysDecider()
        case "never":
            return NeverDecider()
        case "threshold":
            return NonCachedTokensDecider(cfg.min_prefill_tokens)
        case "cost_model":
            return CostModelDecider(
                cost_settings(cfg), clock=clock, cached=None if cache is None else _routed_cache(cache)
            )
        case _:
            assert_never(cfg.type)


def cost_settings(cfg: DeciderCfg) -> CostSettings:
    return CostSettings(
        ttft_slo_s=cfg.ttft_slo_s,
        ttft_slo_x=cfg.ttft_slo_x,
        tpot_slo_s=cfg.tpot_slo_s,
        tpot_slo_x=cfg.tpot_slo_x,
        roomy=cfg.roomy,
        local_penalty=cfg.local_penalty,
        tpot_risk=cfg.tpot_risk,
        joint=cfg.joint,
        pair_candidates=cfg.pair_candidates,
        pair_slack=cfg.pair_slack,
        max_candidates=cfg.max_candidates,
        priors=CostPriors(
            prefill_rate=cfg.prefill_rate,
            prefill_overhead_s=cfg.prefill_overhead_s,
            transfer_s_per_token=cfg.transfer_s_per_token,
            transfer_overhead_s=cfg.transfer_overhead_s,
            tpot_s=cfg.tpot_s,
            crossover_tokens=cfg.crossover_tokens,
            chunk_tokens=cfg.chunk_tokens,
            forget=cfg.forget,
        ),
    )


def _routed_cache(state: CacheState) -> Callable[[Routed, str], int]:
    """What the cache-aware index predicts a routed request finds cached on a worker (read
    before the index records the request)."""

    def cached(ev: Routed, worker_id: str) -> int:
        key = ev.prompt_key
        if key is None:
            return 0
        return state.cached_for(ev.model, key, worker_id)

    return cached
