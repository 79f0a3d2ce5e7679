"""What the SGLang and vLLM adapters (and plain OpenAI-compatible servers) share: both engines
answer in OpenAI's shapes (SGLang's `/generate` adds its own), so reading an answer's text,
marking a stream's end, dropping a usage chunk, recognising a refusal sent as a stream and
building a short greedy re-run are the same for all of them. Each adapter inherits these and
overrides what its engine does differently."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import msgspec

from adapters._cached import openai_cached, stream_cached
from adapters._stream import STREAM_END_MARKERS, refused_in_stream, without_usage_chunk
from adapters._summary import answer_text, payloads_of, stream_text
from adapters.base import HandoffCtx, PrefillVerdict
from common import jsonbytes
from common.request import ParsedRequest
from common.summary import CachedTokens, Summary
from common.workers import RouteKind

# what the gateway adds for a P/D handoff, on any engine, and the client's length and stream
# options: a shadow re-run carries none of them
_NOT_IN_SHADOW = (
    "max_completion_tokens",
    "stream_options",
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "rid",
)


class SharedShapes:
    stream_end_markers: ClassVar[tuple[bytes, ...]] = STREAM_END_MARKERS

    def summarize(self, req: ParsedRequest, payloads: Iterable[bytes]) -> Summary:
        raise NotImplementedError

    def summarize_prefill(self, req: ParsedRequest, body: bytes) -> Summary:
        return self.summarize(req, payloads_of(body))

    def answer_text(self, req: ParsedRequest, body: bytes, *, stream: bool) -> str | None:
        return stream_text(body) if stream else answer_text(body)

    def answer_cached(self, req: ParsedRequest, data: bytes, *, stream: bool) -> CachedTokens | None:
        return stream_cached(data, generate=False) if stream else openai_cached(data)

    def without_usage_chunk(self, events: bytes) -> bytes:
        return without_usage_chunk(events)

    def refused_in_stream(self, body: bytes) -> bool:
        return refused_in_stream(body)

    def shadow_body(self, req: ParsedRequest, tokens: int) -> bytes:
        fields = req.decode_dict()
        if req.route is RouteKind.GENERATE:  # SGLang's native route: the limit is a sampling param
            sp = msgspec.json.decode(fields.get("sampling_params", b"{}"))
            sp = dict(sp) if isinstance(sp, dict) else {}
            sp["max_new_tokens"] = tokens
            set_ = {"sampling_params": msgspec.json.encode(sp), "stream": b"false"}
        else:
            set_ = {"max_tokens": str(tokens).encode(), "stream": b"false"}
        return jsonbytes.rewrite(fields, drop=_NOT_IN_SHADOW, set_=set_)

    def handoff_bodies(self, req: ParsedRequest, ctx: HandoffCtx) -> tuple[bytes, bytes]:
        return self.prefill_body(req, ctx), self.decode_body(req, ctx, None)

    def prefill_body(self, req: ParsedRequest, ctx: HandoffCtx) -> bytes:
        raise NotImplementedError

    def decode_body(self, req: ParsedRequest, ctx: HandoffCtx, prefill: PrefillVerdict | None) -> bytes:
        raise NotImplementedError

    def split_units(self, req: ParsedRequest) -> list[ParsedRequest]:
        raise NotImplementedError(f"{type(self).__name__} does not split requests (splits_samples is false)")
