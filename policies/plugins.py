"""Policy plugins: the `pd_gateway.policies` entry point group.

A plugin package declares, in its pyproject.toml,

    [project.entry-points."pd_gateway.policies"]
    my-policy = "my_pkg.policy:factory"

where `factory(options: dict[str, object]) -> Policy` builds the policy from the `options`
table of `{type = "plugin", name = "my-policy", options = {...}}`. The factory validates its
own options (ideally by `msgspec.convert(options, MyCfg)` with `forbid_unknown_fields`).
`policies.testing.run_conformance` checks a plugin keeps the `Policy` invariants.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from policies.base import Policy

ENTRY_POINT_GROUP = "pd_gateway.policies"

PolicyFactory = Callable[[dict[str, object]], Policy]


class PluginError(Exception):
    """A plugin is missing, fails to load, or its factory returned something that is not a Policy."""


def available_plugins() -> dict[str, EntryPoint]:
    """Installed plugins by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def load_plugin(name: str) -> PolicyFactory:
    """The factory registered under `name`; raises `PluginError`."""
    found = available_plugins()
    ep = found.get(name)
    if ep is None:
        known = ", ".join(sorted(found)) or "none installed"
        raise PluginError(
            f"unknown policy plugin {name!r} (entry point group {ENTRY_POINT_GROUP!r}: {known})"
        )
    try:
        factory = ep.load()
    except Exception as e:  # an import error in third-party code: report it with the plugin's name
        raise PluginError(f"policy plugin {name!r} ({ep.value}) failed to load: {e}") from e
    if not callable(factory):
        raise PluginError(f"policy plugin {name!r} ({ep.value}) is not callable")
    result: PolicyFactory = factory
    return result


def make_plugin_policy(
    name: str, options: dict[str, object], loader: Callable[[str], PolicyFactory]
) -> Policy:
    """Build a plugin's policy and check that it has the `Policy` shape."""
    factory = loader(name)
    try:
        policy = factory(dict(options))
    except Exception as e:  # a factory refusing its options (e.g. msgspec.convert's errors)
        raise PluginError(f"policy plugin {name!r} refused its options: {type(e).__name__}: {e}") from e
    if not isinstance(policy, Policy):
        raise PluginError(f"policy plugin {name!r} returned {type(policy).__name__}, which is not a Policy")
    return policy
