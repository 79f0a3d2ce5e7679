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
