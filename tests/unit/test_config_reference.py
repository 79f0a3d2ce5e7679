"""The configuration reference in docs/configuration.md matches the configuration Structs, the one
source of every default: each section names every field of its Struct and no other, each value
not marked "example" is the field's default, and every flag of `pd-gateway serve` is documented:
in the flags table, or (sglang-router's and vllm-router's own) in docs/migration.md's table."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gateway.cli_args import build_serve_parser
from gateway.config import (
    AdminConfig,
    BreakerConfig,
    FallbackConfig,
    GatewayConfig,
    GuardsConfig,
    HealthConfig,
    KubernetesConfig,
    KvEventsConfig,
    LimitsConfig,
    ListenConfig,
    RetriesConfig,
    TimeoutsConfig,
    WorkerConfig,
)
from gateway.router_flags import ROUTER_FLAGS
from gateway.routing_tokenizer import TokenizerConfig
from policies.config import DeciderCfg

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
MIGRATION = DOC.parent / "migration.md"
SECTIONS: dict[str, type[msgspec.Struct]] = {
    "listen": ListenConfig,
    "decider": DeciderCfg,
    "timeouts": TimeoutsConfig,
    "retries": RetriesConfig,
    "breaker": BreakerConfig,
    "health": HealthConfig,
    "limits": LimitsConfig,
    "guards": GuardsConfig,
    "fallback": FallbackConfig,
    "admin": AdminConfig,
    # a table whose presence turns discovery on: commented out in the example, its keys with it
    "kubernetes": KubernetesConfig,
    "workers.kv_events": KvEventsConfig,  # a worker's sub-table
    "tokenizer": TokenizerConfig,  # (like kubernetes: on when present)
}
_KEY = re.compile(r"^(#\s*)?([a-z_]+)\s*=")
# a table's header, `[name]`, `[[name]]` or `[name.sub]`; commented out (`# [name]`): a table
# shown with every key but off by default (its keys are commented out with it)
_HEADER = re.compile(r"^(# ?)?\[\[?([a-z_.]+)\]\]?\s*(#.*)?$")


class Reference(msgspec.Struct):
    keys: dict[str, set[str]]  # section ("" top level) -> every key it names, set or commented out
    examples: dict[str, set[str]]  # section -> keys whose value is marked "example"
    values: dict[str, Any]  # the TOML document (the keys that are set)
    off: dict[str, dict[str, Any]]  # a commented-out table -> its keys' values, read uncommented


def reference(text: str) -> Reference:
    """The annotated example of docs/configuration.md, read as TOML and line by line (a key
    commented out, `# max_tokens_cap = 32768  # example`, is named all the same; in a table
    commented out whole, `# [kubernetes]`, its keys are read as if they were not)."""
    block = text.split("## Full annotated example", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    keys: dict[str, set[str]] = {"": set()}
    examples: dict[str, set[str]] = {"": set()}
    off: dict[str, list[str]] = {}
    section = ""
    for line in block.splitlines():
        header = _HEADER.match(line)
        if header:
            section = header.group(2)
            keys.setdefault(section, set())
            examples.setdefault(section, set())
            parent, dot, sub = section.rpartition(".")
            if dot:  # `[workers.kv_events]` names the key kv_events of workers
                keys.setdefault(parent, set()).add(sub)
            if header.group(1):
                off[section] = []
            continue
        m = _KEY.match(line)
        if m and not line.startswith("#  "):
            keys[section].add(m.group(2))
            if section in off and m.group(1):
                uncommented = line[len(m.group(1)) :]
                off[section].append(uncommented)
                if "example" in uncommented.partition("#")[2]:
                    examples[section].add(m.group(2))
            elif "example" in line.partition("#")[2] or m.group(1):
                examples[section].add(m.group(2))
    return Reference(
        keys,
        examples,
        tomllib.loads(block),
        {name: tomllib.loads("\n".join(lines)) for name, lines in off.items()},
    )


REF = reference(DOC.read_text())


def _plain(value: Any) -> Any:
    """A default as TOML reads it back (tuples are arrays)."""
    value = msgspec.to_builtins(value)
    return [_plain(x) for x in value] if isinstance(value, tuple | list) else value


def shown(section: str) -> dict[str, Any]:
    """The values the reference gives a section's keys (a worker's sub-table: every worker's)."""
    if section in REF.off:
        return REF.off[section]
    parent, dot, sub = section.rpartition(".")
    if not dot:
        return dict(REF.values.get(section, {}))
    out: dict[str, Any] = {}
    for table in REF.values[parent]:
        out |= table.get(sub, {})
    return out


def _defaults(struct: type[msgspec.Struct]) -> dict[str, Any]:
    return {
        f.name: _plain(f.default)
        for f in msgspec.structs.fields(struct)
        if f.default is not msgspec.NODEFAULT
    }


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_section_names_every_field_of_its_struct(section: str) -> None:
    fields = {f.name for f in msgspec.structs.fields(SECTIONS[section])}
    assert REF.keys[section] == fields


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_value_not_marked_example_is_the_default(section: str) -> None:
    defaults = _defaults(SECTIONS[section])
    values = shown(section)
    assert values.keys() <= REF.keys[section]
    for key, value in values.items():
        if key not in REF.examples[section]:
            assert value == defaults[key], f"[{section}] {key} = {value!r}, the default is {defaults[key]!r}"


def test_the_top_level_keys_and_their_defaults() -> None:
    tables = set(SECTIONS) | {"workers"}  # (kubernetes among them: a table, None by default)
    fields = {f.name for f in msgspec.structs.fields(GatewayConfig)} - tables
    assert REF.keys[""] == fields
    defaults = _defaults(GatewayConfig)
    for key in REF.keys[""] - REF.examples[""]:
        want = defaults[key]
        got = REF.values[key]
        if key == "policy":  # the shorthand of the default policy's table
            assert {"type": got} == want
        else:
            assert got == want, key


def test_the_workers_name_every_field_of_a_worker() -> None:
    assert REF.keys["workers"] == {f.name for f in msgspec.structs.fields(WorkerConfig)}
    for worker in REF.values["workers"]:  # and each example is a valid one
        msgspec.convert(worker, WorkerConfig)


def test_the_commented_out_kubernetes_table_is_a_valid_one() -> None:
    msgspec.convert(REF.off["kubernetes"], KubernetesConfig)


def test_a_wrong_default_in_the_reference_is_seen() -> None:
    """The checks above can fail: a reference whose default drifted from the Struct's."""
    drifted = reference(DOC.read_text().replace("open_s = 30.0 ", "open_s = 45.0 "))
    with pytest.raises(AssertionError):
        assert drifted.values["breaker"]["open_s"] == _defaults(BreakerConfig)["open_s"]
    missing = reference(DOC.read_text().replace("jitter = 0.2", "jiter = 0.2"))
    assert missing.keys["retries"] != {f.name for f in msgspec.structs.fields(RetriesConfig)}
    # ... in a commented-out table, and in a worker's sub-table, too
    off = reference(DOC.read_text().replace("# retry_s = 2.0 ", "# retry_s = 5.0 "))
    assert off.off["kubernetes"]["retry_s"] != _defaults(KubernetesConfig)["retry_s"]
    sub = reference(DOC.read_text().replace("max_blocks = 1048576", "max_block = 1048576"))
    assert sub.keys["workers.kv_events"] != {f.name for f in msgspec.structs.fields(KvEventsConfig)}


def test_every_flag_is_in_the_flags_table_or_the_migration_guide() -> None:
    text = DOC.read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    migration = MIGRATION.read_text()
    routers = {f.flag: f for f in ROUTER_FLAGS}
    for action in build_serve_parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help") or flag.startswith("--no-"):
                continue
            if flag in routers:  # a router's flag: the migration guide's table says what it does
                assert f"| `{flag}` | {routers[flag].text} |" in migration, f"{flag} is not in migration.md"
                continue
            spelt = (re.escape(flag), re.escape("--[no-]" + flag[2:]))  # (a --[no-]X pair)
            assert any(re.search(rf"`[^`]*{s}\b", text) for s in spelt), f"{flag} is not in the flags table"
