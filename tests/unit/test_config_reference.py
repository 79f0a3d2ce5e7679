"""The configuration reference in docs/configuration.md matches the configuration Structs, the one
source of every default: each section names every field of its Struct and no other, each value
not marked "example" is the field's default, and the flags table names every flag of
`pd-gateway serve`."""

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
    LimitsConfig,
    ListenConfig,
    RetriesConfig,
    TimeoutsConfig,
    WorkerConfig,
)
from policies.config import DeciderCfg

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
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
}
_KEY = re.compile(r"^(#\s*)?([a-z_]+)\s*=")
_HEADER = re.compile(r"^\[\[?([a-z_]+)\]\]?")


class Reference(msgspec.Struct):
    keys: dict[str, set[str]]  # section ("" top level) -> every key it names, set or commented out
    examples: dict[str, set[str]]  # section -> keys whose value is marked "example"
    values: dict[str, Any]  # the TOML document (the keys that are set)


def reference(text: str) -> Reference:
    """The annotated example of docs/configuration.md, read as TOML and line by line (a key
    commented out, `# max_tokens_cap = 32768  # example`, is named all the same)."""
    block = text.split("## Full annotated example", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    keys: dict[str, set[str]] = {"": set()}
    examples: dict[str, set[str]] = {"": set()}
    section = ""
    for line in block.splitlines():
        header = _HEADER.match(line)
        if header:
            section = header.group(1)
            keys.setdefault(section, set())
            examples.setdefault(section, set())
            continue
        m = _KEY.match(line)
        if m and not line.startswith("#  "):
            keys[section].add(m.group(2))
            if "example" in line.partition("#")[2] or m.group(1):
                examples[section].add(m.group(2))
    return Reference(keys, examples, tomllib.loads(block))


REF = reference(DOC.read_text())


def _plain(value: Any) -> Any:
    """A default as TOML reads it back (tuples are arrays)."""
    value = msgspec.to_builtins(value)
    return [_plain(x) for x in value] if isinstance(value, tuple | list) else value


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
    shown = REF.values.get(section, {})
    for key, value in shown.items():
        if key not in REF.examples[section]:
            assert value == defaults[key], f"[{section}] {key} = {value!r}, the default is {defaults[key]!r}"


def test_the_top_level_keys_and_their_defaults() -> None:
    tables = set(SECTIONS) | {"workers"}
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


def test_a_wrong_default_in_the_reference_is_seen() -> None:
    """The checks above can fail: a reference whose default drifted from the Struct's."""
    drifted = reference(DOC.read_text().replace("open_s = 30.0 ", "open_s = 45.0 "))
    with pytest.raises(AssertionError):
        assert drifted.values["breaker"]["open_s"] == _defaults(BreakerConfig)["open_s"]
    missing = reference(DOC.read_text().replace("jitter = 0.2", "jiter = 0.2"))
    assert missing.keys["retries"] != {f.name for f in msgspec.structs.fields(RetriesConfig)}


def test_the_flags_table_names_every_flag() -> None:
    text = DOC.read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    for action in build_serve_parser()._actions:
        for flag in action.option_strings:
            if flag in ("-h", "--help") or flag.startswith("--no-"):
                continue
            spelt = (re.escape(flag), re.escape("--[no-]" + flag[2:]))  # (a --[no-]X pair)
            assert any(re.search(rf"`[^`]*{s}\b", text) for s in spelt), f"{flag} is not in the flags table"
