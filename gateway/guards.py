"""KV-integrity guards: a P/D handoff that went wrong must never reach a client as a clean 200.

Four checks, each on by default except shadow verification, each with its own metric
(`pdgw_guard_failures_total{guard,stage}`) and log event (`guard.failed`):

1. `length_preflight` — before dispatch: prompt + max_tokens against the context limit (and
   SGLang's input limit) of **each** chosen worker, for the largest prompt of a batch (the
   engines check each alone). Without a tokenizer a text prompt's UTF-8 bytes are an upper
   bound of its tokens (a byte-level BPE token covers ≥ 1 byte), so a request is refused only
   when even a lower bound (`bytes / max_bytes_per_token`, the bytes themselves a floor read
   off the JSON text, a chat's text parts only) cannot fit; between the two bounds it is let
   through and the engines' own checks (judged by guard 2) decide. Token-id prompts are
   counted exactly.
2. `prefill_verdict` — the adapters' `judge_prefill`: status, abort markers, and for vLLM
   `kv_transfer_params` present, naming this request, covering the prompt's tokens with enough
   blocks. Always on: without it a handoff is not safe at all.
3. `decode_consistency` — the decode's reported prompt tokens equal the prefill's; a
   `finish_reason` of "length" after a single token only when the token budget (or the
   context) was really used up (sglang #33507: an aborted transfer ends with "length" after
   one token; a "length" later than that is an engine's own cap, see `_EARLY_LENGTH_TOKENS`); for greedy
   requests, and single samples drawn with a seed, the decode's first token agrees with the
   token the prefill sampled.
4. `shadow` — a sampled share of greedy requests is re-run colocated for a few tokens and
   compared (see gateway/orchestration/shadow.py).

Everything here is pure: summaries in, a verdict (None = fine, else the reason) out.
"""

from __future__ import annotations

import enum

from common.summary import Summary
from common.workers import WorkerState
from gateway.config import GuardsConfig


class Guard(enum.StrEnum):
    LENGTH_PREFLIGHT = "length_preflight"
    PREFILL_VERDICT = "prefill_verdict"
    DECODE_CONSISTENCY = "decode_consistency"
    SHADOW = "shadow"


# a lower bound of a text prompt's tokens without a tokenizer is its UTF-8 bytes divided by this
# (a byte-level BPE token covers at most this many bytes of the usual text)
MAX_BYTES_PER_TOKEN = 16.0


def preflight(
    prompt_units: int,
    prompt_is_ids: bool,
    max_tokens: int | None,
    workers: tuple[WorkerState, ...],
    s: GuardsConfig,
    *,
    pairs: tuple[tuple[int, int], ...] | None = None,
) -> str | None:
    """Why the request cannot fit a chosen worker, or None. Refuses only what surely cannot fit.
    `prompt_units` is the largest prompt's size and `max_tokens` the budget; `pairs`, where a
    batch gives each prompt its own budget, is (size, budget) per prompt, each checked alone."""
    if pairs is None:
        return _fits(prompt_units, prompt_is_ids, max_tokens or 0, workers, s, "")
    for i, (units, out) in enumerate(pairs):
        why = _fits(units, prompt_is_ids, out, workers, s, f" (prompt {i} of the batch)")
        if why is not None:
            return why
    return None


def _who(w: WorkerState) -> str:
    return f"its {w.role.value} worker"


def _fits(
    units: int, is_ids: bool, out: int, workers: tuple[WorkerState, ...], s: GuardsConfig, which: str
) -> str | None:
    if is_ids:
        low = units
    else:  # a prompt (never empty: refused at parse) is at least one token
        low = max(1, int(units / MAX_BYTES_PER_TOKEN))
    for w in workers:
        # a worker is named by its role, never its id (by default its address: a client's to read);
        # built only for a refusal (`.value` is a Python-level property: two calls a worker)
        if w.max_input_len is not None and low >= w.max_input_len:
            return (
                f"the prompt{which} has at least {low} tokens, but {_who(w)} accepts prompts of "
                f"fewer than {w.max_input_len} tokens"
            )
        if w.context_length is not None and low + out > w.context_length:
            if out >= w.context_length:
                return (
                    f"max_tokens ({out}){which} leaves no room for the prompt in the context length of "
                    f"{w.context_length} tokens of {_who(w)}"
                )
            what = (
                f"the prompt{which}"
                if out == 0
                else f"the prompt{which} (at least {low} tokens) plus max_tokens ({out})"
            )
            return f"{what} exceeds the context length of {w.context_length} tokens of {_who(w)}"
    return None


def check_decode(
    prefill: Summary,
    decode: Summary,
    *,
    max_tokens: int | None,
    context_length: int | None,
    greedy: bool,
) -> str | None:
    """Does the decode's answer agree with the prefill's? None when it does. `greedy`: the first
    token is fixed by the prompt (greedy, or one sample drawn with a seed), so both legs must
    start on the same token."""
    if prefill.prompt_tokens is not None and decode.prompt_tokens is not None:
        if prefill.prompt_tokens != decode.prompt_tokens:
            return (
                f"decode reports {decode.prompt_tokens} prompt tokens, prefill {prefill.prompt_tokens}: "
                "the KV it used is not this prompt's"
            )
    # with no max_tokens the budget is the engine's default (16 on completions, SGLang's 128 on
    # /generate, the context's room on chats): never a single token short of the context, which
    # is judged only where the context is known
    judged = max_tokens is not None or context_length is not None
    if decode.finish_reason == "length" and judged and decode.completion_tokens is not None:
        used = decode.completion_tokens
        at_context = (
            context_length is not None
            and decode.prompt_tokens is not None
            and decode.prompt_tokens + used >= context_length - _CLAMP_SLACK
        )
        short = max_tokens is None or used < max_tokens
        if used <= _EARLY_LENGTH_TOKENS and short and not at_context:
            of = "" if max_tokens is None else f" of {max_tokens}"
            return (
                f"decode finished with 'length' after {used}{of} tokens "
                "(an aborted KV transfer looks like this)"
            )
    if greedy:
        if prefill.first_token_id is not None and decode.first_token_id is not None:
            if prefill.first_token_id != decode.first_token_id:
                if _a_tie(prefill, decode):
                    decode.tied = True
                    return None
                return (
                    f"decode's first token {decode.first_token_id} differs from the prefill's "
                    f"{prefill.first_token_id} on a greedy or seeded request"
                )
        elif (
            prefill.first_text
            and decode.first_text is not None
            and _comparable(prefill.first_text)
            and not (prefill.parsed or decode.parsed)
        ):
            if not _agree(decode.first_text, prefill.first_text):
                if _a_tie(prefill, decode):
                    decode.tied = True
                    return None
                return (
                    f"decode's output starts {decode.first_text[:16]!r}, the prefill sampled "
                    f"{prefill.first_text!r} on a greedy or seeded request"
                )
    return None


def _agree(text: str, token: str) -> bool:
    return text.startswith(token) or token.startswith(text)


def _a_tie(prefill: Summary, decode: Summary) -> bool:
    """Did the decode start on a token the prefill's logprobs put within the near-tie margin of
    its own? vLLM's decode samples the first token again, from its own pass over the prompt's
    last token (the KV of the rest pulled from the prefill): another kernel, another batch, so
    logits that differ in their last bits, and of two near-tied tokens either may win."""
    text = decode.first_text
    if not prefill.ties or not text or decode.parsed:
        return False
    return any(t and _comparable(t) and _agree(text, t) for t in prefill.ties)


# An aborted transfer (sglang #33507) ends with "length" after the one token the prefill sampled.
# A later "length" below max_tokens is an engine's own cap, which a direct client sees too: SGLang's
# scheduler clamps max_new_tokens to its request limit (the context, or a smaller KV pool) less
# the prompt less 1, and SGLANG_MAX_NEW_TOKENS_LIMIT or vLLM's `--override-generation-config
# max_new_tokens` cap every request. Those are not failures and must not be retried as such.
_EARLY_LENGTH_TOKENS = 1
# SGLang's clamp stops 2 tokens short of the context (max_req_len = context - 1, less 1)
_CLAMP_SLACK = 2


def _comparable(text: str) -> bool:
    # a partial UTF-8 sequence detokenizes differently depending on what follows
    return "\ufffd" not in text
