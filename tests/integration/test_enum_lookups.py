"""The request path reads Enum members as module constants: on Python 3.11 each
`EnumClass.MEMBER` in a function goes through `EnumType.__getattr__`'s slot hook, ~900 machine
instructions (docs/benchmarks.md, "Enum members read through a hook"). `bench.enum_lookups`
counts them over `bench.python_cost`'s rig; none is left on a served request's path."""

from __future__ import annotations

import sys

import pytest
import uvloop

from bench.enum_lookups import EnumLookupCounter, count
from common.workers import RouteKind


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", ["nonstream", "stream64"])
def test_a_served_request_looks_up_no_enum_class_attribute(engine: str, mode: str) -> None:
    hits = uvloop.run(count(engine, mode, n=5, warmup=5))
    assert not hits, f"Enum class-attribute look-ups on the request path: {dict(hits)}"


def _looks_up() -> object:
    return RouteKind.CHAT


def test_the_counter_sees_an_enum_class_attribute_look_up() -> None:
    counter = EnumLookupCounter()
    sys.settrace(counter)
    try:
        _looks_up()
    finally:
        sys.settrace(None)
    assert sum(counter.hits.values()) == 1
