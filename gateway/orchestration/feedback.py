"""What an engine says back that a policy learns from: the prompt tokens the engine that prefilled
a request found in its prefix cache (`Completed.cached_tokens`).

A P/D prefill's count comes with its verdict (the adapter reads it from the prefill's answer,
which the gateway reads whole anyway); a colocated answer is read for it only where the policy
uses it (`Needs.cached_tokens`): its whole body, or the end of its stream
(`UpstreamResponse.last_bytes`), nothing per chunk.

OpenAI's `usage.prompt_tokens_details` is left out by both engines when the count is 0, and
altogether unless the server is started to report it: an answer with a usage object but no
details reports 0 only from a worker that has sent details before (`Worker.reports_details`).
"""

from __future__ import annotations

from common.summary import CachedTokens
from gateway.http.client import UpstreamResponse
from gateway.orchestration.context import RequestContext
from gateway.registry import Worker


def reported(w: Worker, c: CachedTokens | None, prompt_tokens: int) -> int | None:
    """The cached tokens `w` reported in an answer (None: it said nothing that counts), in the
    units of the request's `prompt_tokens` (`RequestView.prompt_tokens`): the engine's own for
    token ids; for a text prompt, whose count is the gateway's estimate, the engine's count
    scaled by the estimate over the engine's prompt tokens, so that predictions, reports and
    prompt sizes compare."""
    if c is None:
        return None
    if c.how == "usage":
        return 0 if w.reports_details else None
    if c.how == "details" and not w.reports_details:
        w.reports_details = True
    engine_prompt = c.prompt
    if engine_prompt and engine_prompt != prompt_tokens and c.tokens:
        return min(prompt_tokens, round(c.tokens * prompt_tokens / engine_prompt))
    return c.tokens


def read_colocated(ctx: RequestContext, w: Worker, resp: UpstreamResponse | None) -> None:
    """A colocated answer relayed in full: the cached tokens it reports, into the attempt."""
    if resp is None or resp.status != 200:
        return
    data = resp.last_bytes()
    if not data:
        return
    stream = (resp.header(b"content-type") or b"").startswith(b"text/event-stream")
    cached = w.adapter.answer_cached(ctx.req, data, stream=stream)
    ctx.attempt.cached = reported(w, cached, ctx.view.prompt_tokens)
