"""`Summary`: what an engine's answer says about itself, engine-neutral.

The adapters read answers into it (adapters/_summary.py); the gateway's guards compare a
prefill's against its decode's (gateway/guards.py). A plain value type, so both sides import it
from here and neither imports the other.
"""

from __future__ import annotations

import msgspec


class Summary(msgspec.Struct):
    """What a response (or a stream, once read) says about itself, engine-neutral."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    first_token_id: int | None = None
    first_text: str | None = None
    error: str | None = None  # an error event, or an abort finish (SGLang), in the answer
    # the engine parsed the text (a reasoning or tool-call parser: `reasoning_content`,
    # `tool_calls`): its first text is no measure of the first token
    parsed: bool = False
    # (a prefill's) the texts of the other first tokens its logprobs put within the near-tie margin
    # of the one it drew: a decode starting on one of them drew from near-tied logits
    ties: tuple[str, ...] = ()
    # (a decode's) its first token differed from the prefill's, but was one of the prefill's ties
    tied: bool = False


class CachedTokens(msgspec.Struct, frozen=True, gc=False):
    """The prompt tokens the engine that prefilled a request found in its prefix cache, as its
    answer said it. `how`:

    - "field": a count the engine puts in every answer (SGLang `meta_info.cached_tokens`, vLLM
      0.31+'s `kv_transfer_params.remote_prefill_cached_tokens` from a P/D prefill);
    - "details": OpenAI's `usage.prompt_tokens_details.cached_tokens`, which both engines fill
      only when it is above 0 and only when asked to (SGLang `--enable-cache-report`, vLLM
      `--enable-prompt-tokens-details`);
    - "usage": a usage object without those details (`tokens` 0): no cached tokens if the
      server fills the details at all, else nothing is known (the gateway learns which, per
      worker, from the first "details" it sees)."""

    tokens: int
    how: str  # "field" | "details" | "usage"
    # the prompt's tokens as the engine counted them, where the answer says (its usage, SGLang's
    # meta_info): a text prompt's count is the gateway's estimate, so `tokens` is rescaled to it
    prompt: int | None = None
