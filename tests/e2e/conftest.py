"""Fixtures for the e2e tests against real engines (run by `make e2e-vllm` / `make e2e-sglang`).

Without the lane's environment (E2E_GATEWAY_URL and friends, set by tests/e2e/lane.sh) every test
here is skipped: they need the real engines the lane starts.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e._support import KINDS, Case, Kind, Lane, Outcome, call, cases


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "destructive: kills or breaks an engine server; run after every other e2e test"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests that kill a server go last, whatever the file order.
    items.sort(key=lambda it: it.get_closest_marker("destructive") is not None)


@pytest.fixture(scope="session")
def lane() -> Lane:
    lane = Lane.from_env()
    if lane is None:
        pytest.skip("needs real engines: run `make e2e-vllm` or `make e2e-sglang`")
    return lane


@pytest.fixture(scope="session")
def gateway(lane: Lane) -> OpenAI:
    return lane.client(lane.gateway)


@pytest.fixture(scope="session")
def reference(lane: Lane) -> OpenAI:
    return lane.client(lane.reference)


class References:
    """The single server's greedy outputs, computed once per (kind, stream, case)."""

    def __init__(self, lane: Lane, client: OpenAI) -> None:
        self.lane = lane
        self.client = client
        self._memo: dict[tuple[Kind, bool, int], Outcome] = {}

    def get(self, kind: Kind, stream: bool, case: Case) -> Outcome:
        key = (kind, stream, case.idx)
        if key not in self._memo:
            self._memo[key] = call(self.client, kind, case.prompt, case.max_tokens, stream, self.lane.model)
        return self._memo[key]

    def all(self) -> None:
        for kind in KINDS:
            for stream in (False, True):
                for case in cases():
                    self.get(kind, stream, case)


@pytest.fixture(scope="session")
def refs(lane: Lane, reference: OpenAI) -> References:
    return References(lane, reference)
