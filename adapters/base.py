"""What every engine adapter provides: the one place a wire format is known.

An adapter is pure: it turns a parsed client request into engine request bodies, judges what an
engine answered, and reads the engine's metrics and info endpoints. The orchestrator does the
I/O and picks the handoff shape from `handoff`:

- `HandoffMode.CONCURRENT` (SGLang): the same body, plus a bootstrap room, goes to prefill and
  decode at once; the engines meet through the prefill's bootstrap server.
- `HandoffMode.SEQUENTIAL` (vLLM NIXL): prefill with `max_tokens=1` first; its
  `kv_transfer_params` go verbatim into the decode request.
- `HandoffMode.NONE` (plain OpenAI-compatible servers): colocated only.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import ClassVar, Literal, Protocol

import msgspec

from common.request import ParsedRequest
from common.summary import CachedTokens, Summary
from common.workers import Engine, RouteKind, WorkerLoad, WorkerState


class HandoffMode(enum.Enum):
    NONE = "none"
    SEQUENTIAL = "sequential"
    CONCURRENT = "concurrent"


class HandoffCtx(msgspec.Struct, frozen=True):
    request_id: str
    prefill: WorkerState
    decode: WorkerState
    room: int  # SGLang bootstrap room (first one of a batch); unused by vLLM
    rooms: tuple[int, ...] = ()  # one per batch element / sample when the request is a batch
    # ask the decode for a stream's usage chunk the client did not ask for (the decode guard
    # needs the real token count; the gateway drops the chunk on the way to the client)
    stream_usage: bool = False
    # vLLM: ask a greedy request's prefill for its best `near_ties` first tokens with logprobs
    # (0: not asked); those within `near_tie_margin` nats of its own are ties, not failures
    near_ties: int = 0
    near_tie_margin: float = 0.0


class PrefillVerdict(msgspec.Struct, frozen=True):
    """The adapter's reading of a finished prefill leg."""

    ok: bool
    reason: str = ""
    kv_params: msgspec.Raw | None = None  # vLLM: the object to hand to the decode, verbatim
    retryable: bool = True  # a failure another pair might not have (False: the request is at fault)
    status: int = 200
    body: bytes = b""  # the engine's body, kept for error pass-through
    # the prefill failed because its KV did not reach the decode (SGLang's KVTransferError: the
    # decode gave up or aborted, or the transfer broke): the pair's failure, not the prefill's
    handoff: bool = False
    # must the decode's first token be the prefill's (on greedy or seeded requests)? False where
    # the prefill drew its token from less than the whole prompt
    same_first_token: bool = True
    # the texts of other first tokens near-tied with the prefill's (its logprobs within the margin)
    ties: tuple[str, ...] = ()
    # the prefill refused what the gateway added, not what the client asked (the near-tie
    # logprobs, above a vLLM's --max-logprobs): send it again without
    refused_ask: bool = False
    # the prompt tokens the prefill found in its prefix cache, as its answer says (None: it says
    # nothing); what a cache-aware policy checks its prediction against
    cached: CachedTokens | None = None


def prefill_refused(status: int, body: bytes) -> PrefillVerdict:
    """A prefill that answered HTTP `status` (not 200), its body kept for pass-through:
    retryable on another pair for a server error, a timeout (408) or a busy engine (429);
    any other 4xx is the request's own fault."""
    return PrefillVerdict(
        ok=False,
        reason=f"prefill answered HTTP {status}",
        retryable=status >= 500 or status in (408, 429),
        status=status,
        body=body,
    )


class ProbeInfo(msgspec.Struct, frozen=True):
    """What a worker's info endpoints said about it."""

    model: str | None = None
    context_length: int | None = None
    max_input_len: int | None = None
    disaggregation_mode: str | None = None
    bootstrap_port: int | None = None
    block_size: int | None = None  # KV block (page) size, where the engine reports it
    # its KV cache in tokens, where the engine reports it (SGLang `max_total_num_tokens`, vLLM
    # `num_gpu_blocks` x `block_size`): the cache-aware policy's model of what it can hold
    kv_capacity_tokens: int | None = None


class _ModelCard(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


def apply_models(body: bytes, into: ProbeInfo) -> ProbeInfo:
    """Fold an OpenAI-style `/v1/models` answer (the first model; vLLM and SGLang add
    `max_model_len`) into what is known of a worker."""
    cards = msgspec.json.decode(body, type=_ModelList).data
    if not cards:
        return into
    return msgspec.structs.replace(
        into, model=cards[0].id, context_length=cards[0].max_model_len or into.context_length
    )


class EngineAdapter(Protocol):
    engine: ClassVar[Engine]
    handoff: ClassVar[HandoffMode]
    # P/D with n > 1 must go as n one-sample handoffs, merged by the gateway (gateway/samples.py)
    splits_samples: ClassVar[bool]
    # client routes the engine answers (SGLang's native /generate is SGLang's alone)
    routes: ClassVar[frozenset[RouteKind]]
    # a decode worker of this engine can answer a request alone, prefill included (vLLM's
    # kv_both can; an SGLang decode server cannot)
    decode_alone: ClassVar[bool]
    # the engine's steps decode its running requests beside a prefill's chunks (vLLM's scheduler:
    # running requests first, then prefill chunks in the rest of the token budget), rather than
    # pausing them for prefill-only steps (SGLang's default): how long a prefill stalls a decode
    decodes_beside_prefill: ClassVar[bool]
    # the engine refuses a prompt's token id outside its vocabulary itself (vLLM 0.32 does; SGLang
    # 0.5.23 does not, and one such id kills its scheduler): where it does not, only a configured
    # `vocab_size` lets the gateway refuse it (gateway/orchestration/checks.py)
    checks_token_ids: ClassVar[bool]
    # a prefill worker of this engine has a bootstrap port its decodes fetch the KV from
    # (SGLang's --disaggregation-bootstrap-port): discovery gives it one
    prefill_bootstrap: ClassVar[bool]
    # how its KV-cache events are spelled on the wire and how it hashes blocks, unless the
    # worker's `kv_events.hash` says otherwise (adapters/kvevents.py, adapters/blockhash.py)
    kv_events_format: ClassVar[Literal["vllm", "sglang"]]
    health_path: ClassVar[str]
    load_paths: ClassVar[tuple[str, ...]]
    info_paths: ClassVar[tuple[str, ...]]

    # what marks the stream events that end an answer (a finish reason, an error event): the
    # gateway holds a checked stream's end from the first of them (gateway/streamwatch.py)
    stream_end_markers: ClassVar[tuple[bytes, ...]]

    def colocated_body(self, req: ParsedRequest, request_id: str) -> bytes:
        """The body for a single worker doing both phases (usually the client's bytes)."""
        ...

    def summarize(self, req: ParsedRequest, payloads: Iterable[bytes]) -> Summary:
        """What an answer (a whole body, or a stream's `data:` payloads) says about itself."""
        ...

    def summarize_prefill(self, req: ParsedRequest, body: bytes) -> Summary:
        """What a prefill's answer (read whole, whatever its form) says about itself."""
        ...

    def answer_cached(self, req: ParsedRequest, data: bytes, *, stream: bool) -> CachedTokens | None:
        """The cached prompt tokens a colocated answer reports: `data` is the whole body, or a
        stream's last bytes (its final usage chunk, or on SGLang's `/generate` its last event);
        None where it reports none."""
        ...

    def answer_text(self, req: ParsedRequest, body: bytes, *, stream: bool) -> str | None:
        """The text of a one-answer body (or a stream's bytes), for shadow comparisons; None
        where it has none."""
        ...

    def without_usage_chunk(self, events: bytes) -> bytes:
        """Whole stream events less the usage chunk the gateway asked for and the client did not
        (`HandoffCtx.stream_usage`), as the engine would have sent them without it."""
        ...

    def refused_in_stream(self, body: bytes) -> bool:
        """Is this streamed answer (read whole) the engine refusing the request?"""
        ...

    def shadow_body(self, req: ParsedRequest, tokens: int) -> bytes:
        """The body of a shadow re-run: the request, greedy as sent, for `tokens` tokens, whole,
        without anything the gateway adds for P/D."""
        ...

    def split_units(self, req: ParsedRequest) -> list[ParsedRequest]:
        """`req` as single-prompt, single-sample requests (only asked where `splits_samples`)."""
        ...

    def supports_pd(self, req: ParsedRequest) -> bool:
        """Can this request be disaggregated? If not, the decode worker serves it alone (an
        engine whose decode cannot, `decode_alone` false, must answer True: the orchestrator keeps
        such requests off its decode workers before planning, see `ParsedRequest.local_prefill`)."""
        ...

    def prefill_body(self, req: ParsedRequest, ctx: HandoffCtx) -> bytes: ...

    def decode_body(self, req: ParsedRequest, ctx: HandoffCtx, prefill: PrefillVerdict | None) -> bytes: ...

    def handoff_bodies(self, req: ParsedRequest, ctx: HandoffCtx) -> tuple[bytes, bytes]:
        """(the prefill's, the decode's) bodies of a concurrent handoff, sent at once."""
        ...

    def judge_prefill(self, req: ParsedRequest, ctx: HandoffCtx, status: int, body: bytes) -> PrefillVerdict:
        """Is this prefill answer a sound basis for the decode? Pure; never raises."""
        ...

    def decode_transformer(self, req: ParsedRequest, prefill_body: bytes) -> Callable[[bytes], bytes] | None:
        """A rewrite of the decode's body for the client (SGLang's logprob merge), or None (bytes
        pass through untouched). For streams it is called per received piece, keeps its own
        buffer and returns whole rewritten events; otherwise it is called once with the body."""
        ...

    def abort_call(self, req: ParsedRequest, request_id: str) -> tuple[str, bytes] | None:
        """(path, body) of the engine's abort call, or None when closing the connection is the abort."""
        ...

    def parse_load(self, path: str, body: bytes) -> WorkerLoad | None:
        """The engine's own load report from one of `load_paths` (tried in order until one
        answers 200), or None when the answer holds no load figures (then nothing is assumed)."""
        ...

    def parse_info(self, path: str, body: bytes, into: ProbeInfo) -> ProbeInfo:
        """Fold one info endpoint's answer (`info_paths`) into what is known of the worker."""
        ...
