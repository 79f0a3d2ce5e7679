"""The request path, from a parsed request to the client's answer, by responsibility.

Per request: plan with the policy → run the plan through the workers' adapters → relay the
decode's bytes to the client. Failures before the first byte reached the client are retried on
another worker or pair (the failed ones excluded) up to `retries.max_attempts`; after the first
byte, the client's stream ends with an SSE error event, never a clean `[DONE]`.

Every engine request is tied to the client's: when the client goes away (the server cancels the
handler) or a phase deadline expires, the legs are stopped, their connections closed (vLLM's
abort), and SGLang's `/abort_request` is sent, so no engine keeps working for nobody.

Read from the top:

    orchestrator.py  `Orchestrator`: the facade the handlers call (`context`, `serve`), the
                     attempt loop, the request's end (error answer, metrics, access log)
    context.py       `RequestContext` (one request's state) and its `Attempt`
    attempts.py      planning with exclusions, the fallback ladder, backoff
    dispatch.py      one attempt's plan to the handoff shape that runs it
    checks.py        before dispatch: vocabulary, length preflight, why a plan is a Reject
    quarantine.py    queries of death: no blind retry after an engine died holding a request
    token_bounds.py  without a vocabulary size: token ids proven served, unproven ids alone
    colocated.py     one worker does both phases
    concurrent.py    SGLang: prefill and decode at once, the decode held until the verdict
    sequential.py    vLLM: prefill, judge its KV params, then decode (moved if unreached)
    split.py         n > 1 and batches on SGLang: one handoff per unit, merged
    legs.py          `Leg` and `Handoff`: guards that free, abort and report exactly once
    blame.py         who failed (pure)
    relay.py         the answer to the client, whole or streamed, checked where guarded
    verify.py        the decode-consistency check of a handoff
    shadow.py        shadow verification (before and after delivery)
    services.py      what they all use (registry, policy, metrics, configuration, abort calls)
"""

from gateway.orchestration.context import Phase, RequestContext
from gateway.orchestration.orchestrator import Orchestrator

__all__ = ["Orchestrator", "Phase", "RequestContext"]
