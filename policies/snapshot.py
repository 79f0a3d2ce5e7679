"""The data policies read: frozen views of the cluster and of one request, and the plans they return.

Everything here is a frozen msgspec Struct. The gateway's registry builds a new
`ClusterSnapshot` when something changes (a probe, a scrape, a request starting or ending);
policies only read it. Nothing in this module does I/O.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from policies.prompt_key import PromptKey


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class Engine(enum.StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"


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


class ClusterSnapshot(msgspec.Struct, frozen=True):
    version: int
    workers: tuple[WorkerState, ...]

    def pool(self, role: Role, model: str, exclude: frozenset[str] = frozenset()) -> tuple[WorkerState, ...]:
        """Usable workers of `role` serving `model`, minus the excluded ids."""
        return tuple(
            w for w in self.workers if w.role is role and w.usable and w.serves(model) and w.id not in exclude
        )

    def get(self, worker_id: str) -> WorkerState | None:
        for w in self.workers:
            if w.id == worker_id:
                return w
        return None

    def models(self) -> tuple[str, ...]:
        return tuple(sorted({w.model for w in self.workers if w.model is not None}))


class RouteKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"


class RequestView(msgspec.Struct, frozen=True, gc=False):
    """Only what routing needs, computed once per request by the gateway."""

    request_id: str
    model: str
    route: RouteKind
    prompt_tokens: int  # exact with a tokenizer, else a conservative estimate
    max_tokens: int
    stream: bool = False
    n: int = 1
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of fixed-size prompt blocks
    session_key: str | None = None
    greedy: bool = False
    # the prompt for prefix matching (token ids, else canonical text); None: not keyed (a
    # batch, or a request path that does not key requests) -- see policies/prompt_key.py
    prompt_key: PromptKey | None = None


# ---- plans -------------------------------------------------------------------------------


class Colocated(msgspec.Struct, frozen=True, tag="colocated"):
    """One worker runs both phases (a colocated worker, or a decode worker doing its own prefill)."""

    worker: WorkerState
    reason: str = ""


class Disaggregated(msgspec.Struct, frozen=True, tag="disaggregated"):
    prefill: WorkerState
    decode: WorkerState
    reason: str = ""


class Reject(msgspec.Struct, frozen=True, tag="reject"):
    """No plan is possible. `status` is the HTTP status the gateway answers with."""

    reason: str
    status: int = 503


Plan = Colocated | Disaggregated | Reject
