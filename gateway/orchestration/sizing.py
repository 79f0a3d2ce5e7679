"""Whose a request's total deadline is (issue #27, item 3): a timeout that the request's own size
explains is its client's, not its workers'.

A valid request may ask for more work than the gateway's deadline allows (`n` = 128 and
`max_tokens` = 8000): when it runs past `timeouts.total_s`, no engine did wrong, and counting it
against the workers let a few such requests open a pair's breaker (the model down for everyone
for `breaker.open_s`). The request's own time is reckoned as the gateway reckons a non-streamed
answer's wait (`timeouts.per_token_s` per token it may generate: `max_tokens` x `n` x prompts),
plus the same per `PROMPT_TOKENS_PER_OUTPUT` tokens of its prompts. When that exceeds
`total_s` and the total deadline fires, the attempt's legs get no verdict (no breaker counts
them: `RequestContext.unjudged`) and the client is told why (`RequestExceedsDeadline`).
"""

from __future__ import annotations

from common.errors import ErrorCode, GatewayError
from gateway.config import TimeoutsConfig
from policies.snapshot import RequestView

# a prompt token is computed in a batch with its prompt's others: reckoned as this many to one
# generated token (an engine's prefill runs thousands of tokens a second, its decode tens)
PROMPT_TOKENS_PER_OUTPUT = 50


class RequestExceedsDeadline(GatewayError):
    """A request that ran past the total deadline its own size did not fit in."""

    status = 504
    code = ErrorCode.REQUEST_EXCEEDS_DEADLINE
    type = "invalid_request_error"


def work_s(view: RequestView, t: TimeoutsConfig) -> float:
    """The time the request's own size may take (module docstring)."""
    return t.per_token_s * (view.max_tokens + view.prompt_tokens / PROMPT_TOKENS_PER_OUTPUT)


def outgrows(view: RequestView, t: TimeoutsConfig) -> bool:
    """Does the request's own size explain a run past `total_s`?"""
    # (`work_s`, inline: one frame fewer per request)
    return t.per_token_s * (view.max_tokens + view.prompt_tokens / PROMPT_TOKENS_PER_OUTPUT) > t.total_s


def exceeded(view: RequestView, t: TimeoutsConfig) -> RequestExceedsDeadline:
    """The client's error for a request that outgrew the total deadline."""
    return RequestExceedsDeadline(
        f"the request did not finish within the gateway's deadline of {t.total_s:g}s, and its own "
        f"size explains it: up to {view.max_tokens} output tokens (max_tokens x n x prompts) and "
        f"about {view.prompt_tokens} prompt tokens, reckoned at {t.per_token_s:g}s per output "
        "token; ask for fewer tokens or samples per request"
    )
