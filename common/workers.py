"""The value types every layer shares about workers and routes: what a worker is (`Engine`,
`Role`), what it reports (`WorkerLoad`), how policies and adapters see it (`WorkerState`), and
which client route a request came by (`RouteKind`).

Frozen msgspec Structs and enums, no behaviour: the gateway builds them, policies read them
(`policies.snapshot` re-exports them for policy authors), adapters read a worker's facts from
them (its URL, bootstrap port, block size).
"""

from __future__ import annotations

import enum

import msgspec


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Engine(enum.StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"


class RouteKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"


# The members as module constants, for the request path: on Python 3.11 `RouteKind.CHAT` read
# inside a function goes through EnumType's slot hook, unspecialised (~70 ns here); a module
# global does not (~7 ns) (docs/benchmarks.md, "Enum members read through a hook")
CHAT_ROUTE, COMPLETIONS_ROUTE, GENERATE_ROUTE = RouteKind.CHAT, RouteKind.COMPLETIONS, RouteKind.GENERATE


class WorkerLoad(msgspec.Struct, frozen=True, gc=False):
    """What the engine itself reports (scraped from its /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # 0..1
    cache_hit_rate: float = 0.0  # 0..1
    scraped_at: float = 0.0  # monotonic seconds; 0 = never scraped


class WorkerState(msgspec.Struct, frozen=True, gc=False):
    """One worker as policies see it. `id` is the stable key (not the URL string)."""

    id: str
    url: str
    role: Role
    engine: Engine
    model: str | None = None  # None until probed: matches any model
    healthy: bool = True
    draining: bool = False
    context_length: int | None = None  # prompt + output tokens the worker accepts
    max_input_len: int | None = None  # prompt tokens it accepts (SGLang's max_req_input_len)
    bootstrap_port: int | None = None  # SGLang prefill only
    block_size: int | None = None  # KV block size the engine reports (vLLM: cache_config_info)
    vocab_size: int | None = None  # configured: prompt token ids must be below it
    kv_capacity_tokens: int | None = None  # KV cache size in tokens, where known (cache-aware routing)
    # a decode worker of this engine answers a request alone, prefill included (vLLM's kv_both
    # can; an SGLang decode server cannot): its adapter's `decode_alone`
    decode_alone: bool = False
    # its steps decode the running requests beside a prefill's chunks (vLLM), rather than pausing
    # them for prefill-only steps (SGLang): its adapter's `decodes_beside_prefill`
    decodes_beside_prefill: bool = False
    weight: float = 1.0
    labels: tuple[tuple[str, str], ...] = ()
    inflight: int = 0  # requests the gateway has in flight on it
    inflight_tokens: int = 0  # prompt + max tokens of those requests
    load: WorkerLoad = WorkerLoad()

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def serves(self, model: str) -> bool:
        return self.model is None or self.model == model
