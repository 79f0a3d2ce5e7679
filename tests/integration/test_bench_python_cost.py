"""`bench.python_cost` drives the real gateway over in-memory transports; its figures are only
worth something while every answer it gets is right, so each engine and mode runs a few
requests here (the rig raises on a wrong answer or a stuck request)."""

from __future__ import annotations

import pytest
import uvloop

from bench.python_cost import measure


@pytest.mark.parametrize("target", ["gateway", "bare-pd"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", ["nonstream", "stream64"])
def test_python_cost_rig_serves_every_request(target: str, engine: str, mode: str) -> None:
    r = uvloop.run(measure(engine, mode, n=50, repeats=1, target=target))
    assert r["requests"] == 50 and len(r["us_per_request"]) == 1 and r["us_per_request"][0] > 0


@pytest.mark.parametrize("target", ["gateway", "bare-pd"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_python_cost_rig_streams_event_by_event(target: str, engine: str) -> None:
    r = uvloop.run(measure(engine, "stream64", n=50, repeats=1, target=target, apart=True))
    assert r["requests"] == 50 and r["us_per_request"][0] > 0
