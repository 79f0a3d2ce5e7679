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
from typing import Any

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


class PluginCfg(_Cfg, tag="plugin", frozen=True):
    """A policy from the `pd_gateway.policies` entry point group; `options` go to its factory."""

    name: str
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("plugin name must not be empty")


PolicyCfg = RoundRobinCfg | RandomCfg | LeastLoadCfg | PowerOfTwoCfg | PluginCfg

BUILTIN_POLICY_NAMES: tuple[str, ...] = ("round_robin", "random", "least_load", "power_of_two")


class DeciderCfg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The disaggregation decider: P/D when `prompt_tokens - cached >= min_prefill_tokens`.

    0 (the default) always disaggregates when a P/D pool serves the model.
    """

    min_prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if self.min_prefill_tokens < 0:
            raise ValueError("min_prefill_tokens must be >= 0")


def policy_shorthand(value: str) -> dict[str, object]:
    """`"least_load"` -> `{"type": "least_load"}`; `"plugin:NAME"` -> `{"type": "plugin", "name": NAME}`."""
    if value.startswith("plugin:"):
        return {"type": "plugin", "name": value.removeprefix("plugin:")}
    return {"type": value}


def parse_policy(value: str | Mapping[str, object]) -> PolicyCfg:
    """A policy config from its string shorthand or a table; raises `msgspec.ValidationError`."""
    raw = policy_shorthand(value) if isinstance(value, str) else dict(value)
    return msgspec.convert(raw, PolicyCfg)
