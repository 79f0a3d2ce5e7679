"""The orchestrator's settings (built from the configuration by gateway/app.py)."""

from __future__ import annotations

import msgspec

from gateway.guards import GuardSettings


class Timeouts(msgspec.Struct, frozen=True):
    connect_s: float = 2.0
    prefill_s: float = 60.0  # to the prefill's verdict (SGLang: also to the decode's headers)
    handoff_s: float = 30.0  # decode's response headers after the prefill finished
    # a non-streamed answer's headers come with its last token: per token it may generate, this
    # much is added to the wait for them (prefill_s colocated, handoff_s after a prefill)
    per_token_s: float = 0.25
    idle_s: float = 60.0  # between two body chunks of a stream
    total_s: float = 600.0  # the whole request
    abort_s: float = 2.0  # an abort call to an engine
    abort_repeat_s: float = 0.5  # the abort call is sent again after this long
    shortage_s: float = 4.0  # after running out of descriptors, pools keep no idle connection this long


class RetrySettings(msgspec.Struct, frozen=True):
    max_attempts: int = 3
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2


class OrchestratorSettings(msgspec.Struct, frozen=True):
    timeouts: Timeouts = Timeouts()
    retries: RetrySettings = RetrySettings()
    chars_per_token: float = 4.0  # estimate for text prompts when no tokenizer is configured
    forward_authorization: bool = False
    guards: GuardSettings = GuardSettings()
    # rungs tried after a failure before the first byte: "other_pair", "colocated",
    # "decode_self_prefill", then "shed" (503 + Retry-After naming the failure) when none is left
    ladder: tuple[str, ...] = ("other_pair", "colocated", "decode_self_prefill", "shed")
    split_concurrency: int = 32  # handoffs of one split request (n > 1, SGLang batches) at once
    retry_after_s: float = 1.0  # Retry-After of a 503 for no route or no fallback left
