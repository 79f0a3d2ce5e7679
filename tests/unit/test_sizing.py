"""Whose a run past the total deadline is (gateway/orchestration/sizing.py): the client's when the
request's own size (max_tokens x n x prompts at `per_token_s`, prompts at a fiftieth of that)
does not fit in `total_s`, else the workers'."""

from __future__ import annotations

import pytest

from common.workers import RouteKind
from gateway.config import TimeoutsConfig
from gateway.orchestration.sizing import exceeded, outgrows, work_s
from policies.snapshot import RequestView

T = TimeoutsConfig()  # total_s 600, per_token_s 0.25


def view(prompt: int, out: int) -> RequestView:
    return RequestView(
        request_id="r", model="m", route=RouteKind.COMPLETIONS, prompt_tokens=prompt, max_tokens=out
    )


@pytest.mark.parametrize(
    ("prompt", "out", "client"),
    [
        (100, 128 * 8000, True),  # issue #27's n=128, max_tokens=8000
        (100, 2000, False),  # 500 s of its own: a worker that cannot is failing
        (100, 2397, False),  # 599.75 s with its prompt: just within
        (100, 2399, True),  # 600.25 s
        (150_000, 1, True),  # a prompt alone may do it: 750 s at a fiftieth of per_token_s
        (1000, 16, False),
    ],
)
def test_a_request_outgrows_the_deadline_by_its_own_size(prompt: int, out: int, client: bool) -> None:
    assert outgrows(view(prompt, out), T) is client
    assert work_s(view(prompt, out), T) == pytest.approx(0.25 * (out + prompt / 50))


def test_the_client_is_told_what_to_change() -> None:
    e = exceeded(view(100, 128 * 8000), T)
    assert (
        e.status == 504 and e.code.value == "request_exceeds_deadline" and e.type == "invalid_request_error"
    )
    assert "1024000 output tokens" in e.message and "600s" in e.message
