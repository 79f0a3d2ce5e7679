"""What every configuration section shares: `ConfigError`, the strict `_Section` base, the
range checks of `__post_init__`, and the size units (gateway/config.py puts them together)."""

from __future__ import annotations

import math

import msgspec

MiB = 1024 * 1024
KiB = 1024
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


class ConfigError(Exception):
    """The configuration is invalid; the message says which key and why."""


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


def _positive(section: str, **values: float) -> None:
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{section}.{name} must be a positive number, got {value!r}")


def _non_negative(section: str, **values: float) -> None:
    for name, value in values.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{section}.{name} must be >= 0, got {value!r}")
