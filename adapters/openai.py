"""Any OpenAI-compatible server (vLLM or SGLang in normal mode, or others): colocated passthrough."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar, Literal

from adapters._shapes import SharedShapes
from adapters._summary import summarize_openai
from adapters.base import HandoffCtx, HandoffMode, PrefillVerdict, ProbeInfo, apply_models
from adapters.prom import sum_metrics
from common.request import ParsedRequest
from common.summary import Summary
from common.workers import Engine, RouteKind, WorkerLoad


class OpenAIAdapter(SharedShapes):
    engine: ClassVar[Engine] = Engine.OPENAI
    handoff: ClassVar[HandoffMode] = HandoffMode.NONE
    splits_samples: ClassVar[bool] = False  # colocated only
    routes: ClassVar[frozenset[RouteKind]] = frozenset((RouteKind.COMPLETIONS, RouteKind.CHAT))
    decode_alone: ClassVar[bool] = True  # colocated only: never a decode
    decodes_beside_prefill: ClassVar[bool] = False  # unknown: a prefill may hold its decodes
    checks_token_ids: ClassVar[bool] = True  # (an OpenAI-compatible server's own concern)
    prefill_bootstrap: ClassVar[bool] = False
    # an OpenAI server's events are read in vLLM's spelling; its hash scheme must be configured
    kv_events_format: ClassVar[Literal["vllm", "sglang"]] = "vllm"
    health_path: ClassVar[str] = "/health"
    load_paths: ClassVar[tuple[str, ...]] = ("/metrics",)
    info_paths: ClassVar[tuple[str, ...]] = ("/v1/models",)

    def colocated_body(self, req: ParsedRequest, request_id: str) -> bytes:
        return req.body

    def summarize(self, req: ParsedRequest, payloads: Iterable[bytes]) -> Summary:
        return summarize_openai(payloads)

    def supports_pd(self, req: ParsedRequest) -> bool:
        return False

    def prefill_body(self, req: ParsedRequest, ctx: HandoffCtx) -> bytes:
        raise NotImplementedError("plain OpenAI-compatible servers have no P/D protocol")

    def decode_body(self, req: ParsedRequest, ctx: HandoffCtx, prefill: PrefillVerdict | None) -> bytes:
        raise NotImplementedError("plain OpenAI-compatible servers have no P/D protocol")

    def judge_prefill(self, req: ParsedRequest, ctx: HandoffCtx, status: int, body: bytes) -> PrefillVerdict:
        return PrefillVerdict(ok=False, reason="no P/D protocol", retryable=False)

    def decode_transformer(self, req: ParsedRequest, prefill_body: bytes) -> Callable[[bytes], bytes] | None:
        return None

    def abort_call(self, req: ParsedRequest, request_id: str) -> tuple[str, bytes] | None:
        return None

    def parse_load(self, path: str, body: bytes) -> WorkerLoad | None:
        # vLLM and SGLang in normal mode publish their own names; read whichever is there.
        m = sum_metrics(
            body.decode("utf-8", "replace"),
            (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
            ),
        )
        if not m:
            return None  # a server without these gauges: nothing is known, nothing is assumed
        return WorkerLoad(
            running=int(m.get("vllm:num_requests_running", 0.0) + m.get("sglang:num_running_reqs", 0.0)),
            waiting=int(m.get("vllm:num_requests_waiting", 0.0) + m.get("sglang:num_queue_reqs", 0.0)),
        )

    def parse_info(self, path: str, body: bytes, into: ProbeInfo) -> ProbeInfo:
        if path == "/v1/models":
            return apply_models(body, into)
        return into
