"""Build a `Policy` from its config: one exhaustive `match` over the closed set of policy types.

`build_policy(cfg)` with one config gives every role the same policy. `prefill` / `decode`
override the policy for those roles (`--prefill-policy`, `--decode-policy`); the colocated
pool always uses `cfg`. A plugin given alone owns the whole plan; a plugin combined with
other role policies must also implement `RoleSelector` (`select` + `observe`).
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from typing import assert_never

from policies.base import NonCachedTokensDecider, Policy, RoleSelector
from policies.config import (
    DeciderCfg,
    LeastLoadCfg,
    PluginCfg,
    PolicyCfg,
    PowerOfTwoCfg,
    RandomCfg,
    RoundRobinCfg,
    _LoadCfg,
)
from policies.least_load import LoadWeights, least_load_profile
from policies.pd import PDPolicy
from policies.plugins import PluginError, PolicyFactory, load_plugin, make_plugin_policy
from policies.power_of_two import power_of_two_profile
from policies.random import random_profile
from policies.round_robin import round_robin_profile


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


def build_selector(
    cfg: PolicyCfg, role: str, *, loader: Callable[[str], PolicyFactory] = load_plugin
) -> RoleSelector:
    """The selector for one role ("prefill", "decode" or "colocated")."""
    match cfg:
        case RoundRobinCfg():
            return round_robin_profile(f"round_robin/{role}")
        case RandomCfg():
            return random_profile(_rng(cfg.seed, role), f"random/{role}")
        case LeastLoadCfg():
            return least_load_profile(_weights(cfg), f"least_load/{role}")
        case PowerOfTwoCfg():
            return power_of_two_profile(_weights(cfg), _rng(cfg.seed, role), f"power_of_two/{role}")
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
) -> Policy:
    """The gateway's policy. Raises `PolicyBuildError`."""
    decider = decider if decider is not None else DeciderCfg()
    prefill_cfg = prefill if prefill is not None else cfg
    decode_cfg = decode if decode is not None else cfg
    if isinstance(cfg, PluginCfg) and prefill_cfg == cfg and decode_cfg == cfg:
        return _plugin(cfg, loader)
    labels = [_label(cfg), _label(prefill_cfg), _label(decode_cfg)]
    name = labels[0] if len(set(labels)) == 1 else f"{labels[0]}(prefill={labels[1]},decode={labels[2]})"
    return PDPolicy(
        name,
        decode=build_selector(decode_cfg, "decode", loader=loader),
        prefill=build_selector(prefill_cfg, "prefill", loader=loader),
        colocated=build_selector(cfg, "colocated", loader=loader),
        decider=NonCachedTokensDecider(decider.min_prefill_tokens),
    )
