"""Where a P/D answer may depart from the single server's: only at a near tie of the single
server's own top two tokens (vLLM). Shared by the tests that compare P/D answers with the single
server's token for token (test_pd.py, test_guards.py).

Why a departure at a near tie is no fault: the prefill's KV is computed in another batch shape
(and, on the CPU, through other bf16 kernels) than the single server's own, and vLLM's decode
computes the prompt's last token itself, so logits that differ in their last bits make either of
two near-tied tokens the greedy choice. Seen on real vLLM 0.32 on the CPU at gaps of 0.0000 nats
(tests/e2e/README.md). A departure anywhere else is what a wrong KV would look like, and fails.
"""

from __future__ import annotations

from openai import OpenAI

from tests.e2e._support import Case, Kind, Lane, Outcome, call, request_kwargs

# How far apart (in nats) the single server's top two tokens may be where a P/D answer departs
# from it. A departure anywhere else fails the test.
NEAR_TIE_NATS = 0.05


def single_top(reference: OpenAI, kind: Kind, case: Case, model: str, at: int) -> dict[int, float]:
    """The single server's top-5 token ids and logprobs at generated position `at` (vLLM:
    `return_tokens_as_token_ids` names each as `token_id:N`)."""
    extra: dict[str, object] = {"return_tokens_as_token_ids": True}
    kw = request_kwargs(kind, model, case.prompt, case.max_tokens, False, **extra)
    if kind == "chat":
        kw.update(logprobs=True, top_logprobs=5)
        r = reference.chat.completions.create(**kw)
        content = r.choices[0].logprobs.content
        tops = content[at].top_logprobs if content is not None else []
        return {int(t.token.split(":")[1]): t.logprob for t in tops}
    kw["logprobs"] = 5
    r = reference.completions.create(**kw)
    lp = r.choices[0].logprobs
    top = lp.top_logprobs[at] if lp is not None and lp.top_logprobs is not None else {}
    return {int(k.split(":")[1]): v for k, v in top.items()}


def near_tie_departure(
    lane: Lane, reference: OpenAI, kind: Kind, case: Case, got: Outcome, want: Outcome
) -> str | None:
    """None where `got` (P/D, whole) equals `want` (single server, whole) up to a position where
    the single server's own top two were within NEAR_TIE_NATS and `got` took the runner-up (after
    that the answers legitimately differ); otherwise why the departure is not such a tie, with
    the single server's top-two gap at the first departing token."""
    if lane.engine != "vllm" or got.token_ids is None or want.token_ids is None:
        return "no token ids to compare"
    at = next(
        (i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=False)) if a != b), None
    )
    if at is None or got.prompt_tokens != want.prompt_tokens:
        return "not a departure at a generated token"
    top = single_top(reference, kind, case, lane.model, at)
    ranked = sorted(top.values(), reverse=True)
    top2 = f"the single server's top two {ranked[0] - ranked[1]:.4f} nats apart" if len(ranked) > 1 else ""
    first, other = want.token_ids[at], got.token_ids[at]
    if first not in top or other not in top:
        return f"at token {at}: P/D's {other} not in the single server's top 5 {top} ({top2})"
    gap = top[first] - top[other]
    if gap > NEAR_TIE_NATS:
        return f"at token {at}: {first} leads P/D's {other} by {gap:.4f} nats > {NEAR_TIE_NATS} ({top2})"
    print(f"{kind} case {case.idx}: departs at token {at}, a near tie ({gap:.4f} nats; {top2})")
    return None


def unexplained_departure(
    lane: Lane,
    gateway: OpenAI,
    reference: OpenAI,
    kind: Kind,
    case: Case,
    stream: bool,
    got: Outcome,
    want: Outcome,
    whole: Outcome,
) -> str | None:
    """None where `got` (P/D through `gateway`) equals `want` (the single server's answer of the
    same shape), or departs from it only at a near tie; otherwise what is wrong. `whole` is the
    single server's whole answer (`want` itself when not streamed): a stream is compared by text,
    so where it departs, the gateway's whole answer is asked for (P/D again, same prompt) and must
    depart at a near tie, and the stream must carry its text."""
    if got.same_generation() != want.same_generation() or got.prompt_tokens != want.prompt_tokens:
        pd_whole = got if not stream else call(gateway, kind, case.prompt, case.max_tokens, False, lane.model)
        why = near_tie_departure(lane, reference, kind, case, pd_whole, whole)
        if why is not None:
            return why
        whole = pd_whole
    if stream and got.text != whole.text:
        return "stream text != whole text"
    return None
