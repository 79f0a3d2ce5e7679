"""SGLang P/D: the same body plus a bootstrap room goes to prefill and decode at once.

Wire facts (SGLang 0.5.23 `managers/io_struct.py` `GenerateReqInput` and
`disaggregation/common/conn.py`; sglang-router 0.3.2 `pd_types.rs` `generate_room_id`):
`bootstrap_host` is the prefill's host, `bootstrap_port` its bootstrap server's port,
`bootstrap_room` a random 63-bit integer that both engines use as the rendezvous key. A scalar
room in a batch of n is read by the engine as room+i for element i (`_normalize_bootstrap_params`),
so scalars are sent for batches and `n > 1` too. The decode's response is the client's; the
prefill's is read to the end and judged: a prefill that fails or aborts (SGLang answers 200 with
an abort event on streams) means the decode will wait for KV that never comes (300 s by
default), so the orchestrator aborts it.

Request names (`rid`): SGLang 0.5.23 refuses a second in-flight request with a rid it already
holds ("Duplicate request ID detected", tokenizer_manager.py:3834-3836), and its scheduler aborts
every request whose rid *starts with* an aborted one (scheduler.py:5677, 5688 and the P/D queues
after them: `req.rid.startswith(recv_req.rid)`), whether the abort is an `/abort_request` or the
server's own reaction to a closed connection (`_release_req_states_on_failure`). The rid the
gateway sends is therefore never the client's X-Request-Id (clients reuse ids; "a" would abort
"ab"): it is `<16 hex digits unique to this upstream request>-<request id>`, the request id kept
for correlation in the engine's logs. Rids of equal-width unique parts can only be prefixes of
each other when those parts are equal, i.e. for the two legs of one handoff, which go to
different servers. The unique part is the handoff's bootstrap room (random, 63 bits, already
unique per handoff: the engines pair legs by it) on P/D legs, a process-wide sequence started at
a random point on colocated requests. Batches and `n > 1` get no rid (SGLang names each item
with its own uuid4 hex; a scalar rid would become `rid_0`, `rid_1`, ..., `rid_10`: prefixes of
each other). A client's own `rid` field gets the same unique part in front (`_client_rid`): passed
as sent, "7" would abort every request whose unique part starts with 7.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable, Iterable
from typing import ClassVar, Literal
from urllib.parse import urlsplit

import msgspec

from adapters._cached import _Usage, from_meta, from_usage, generate_cached, stream_cached
from adapters._shapes import SharedShapes
from adapters._split import split_units
from adapters._summary import summarize_generate, summarize_openai
from adapters.base import HandoffCtx, HandoffMode, PrefillVerdict, ProbeInfo, apply_models, prefill_refused
from adapters.prom import sum_metrics
from common import jsonbytes as _body
from common.request import ParsedRequest
from common.summary import CachedTokens, Summary
from common.workers import GENERATE_ROUTE as _GENERATE
from common.workers import Engine, RouteKind, WorkerLoad

_OWNED = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# with the gateway's own rid: a client's `"rid": null` (parsed as no rid) goes too
_OWNED_RID = (*_OWNED, "rid")

# The unique part of colocated requests' rids: 16 hex digits of a sequence that starts at a random
# point per process (several gateways in front of one server do not meet).
_sequence = itertools.count(int.from_bytes(os.urandom(8), "big"))
_MASK = (1 << 64) - 1


def _new_sequence() -> None:
    """A forked process (`serve --workers N`) starts its own: copies of the parent's would send
    one rid from two processes (SGLang refuses the second, and aborts both by name)."""
    global _sequence
    _sequence = itertools.count(int.from_bytes(os.urandom(8), "big"))


os.register_at_fork(after_in_child=_new_sequence)


def _sent_here(req: ParsedRequest) -> dict[str, tuple[int, bytes] | str]:
    """What was last sent to an engine as the rid of this client request, per request id (a
    split request's samples have their own): (the unique part, `"rid":"<unique>-<request id>"`
    as sent) for the gateway's rids, the name itself for a client's. `abort_call` names what was
    sent, and a handoff's decode leg reuses its prefill leg's. Kept on the request itself, so two
    requests that share an X-Request-Id never see each other's."""
    sent = req.engine_rids
    if sent is None:
        sent = req.engine_rids = {}
    return sent


class _FinishReason(msgspec.Struct):
    type: str | None = None
    status_code: int | None = None
    message: str | None = None


class _MetaInfo(msgspec.Struct):
    finish_reason: _FinishReason | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None


class _GenerateOut(msgspec.Struct):
    meta_info: _MetaInfo | None = None


class _Choice(msgspec.Struct):
    finish_reason: str | None = None


class _OpenAIOut(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: msgspec.Raw = msgspec.Raw()  # empty: absent
    object: str | None = None
    message: str | None = None


_gen_dec = msgspec.json.Decoder(_GenerateOut | list[_GenerateOut])
_oai_dec = msgspec.json.Decoder(_OpenAIOut)


class _ServerInfo(msgspec.Struct):
    context_length: int | None = None
    max_total_num_tokens: int | None = None  # its KV pool in tokens
    max_req_input_len: int | None = None
    disaggregation_mode: str | None = None
    disaggregation_bootstrap_port: int | None = None


def _host_of(url: str) -> str:
    return urlsplit(url).hostname or "127.0.0.1"


@functools.lru_cache(maxsize=4096)
def _bootstrap_prefix(prefill_url: str, bootstrap_port: int | None) -> bytes:
    """`"bootstrap_host":...,"bootstrap_port":...,"bootstrap_room":` for one prefill worker
    (a pure function of its URL and port, memoised: per request only the room is formatted)."""
    return _body.pairs(
        bootstrap_host=_body.encoder.encode(_host_of(prefill_url)),
        bootstrap_port=b"null" if bootstrap_port is None else str(bootstrap_port).encode(),
        bootstrap_room=b"",
    )


class SGLangAdapter(SharedShapes):
    engine: ClassVar[Engine] = Engine.SGLANG
    handoff: ClassVar[HandoffMode] = HandoffMode.CONCURRENT
    splits_samples: ClassVar[bool] = True  # 0.5.23 gives all samples one room: n > 1 hangs in P/D
    routes: ClassVar[frozenset[RouteKind]] = frozenset(RouteKind)
    decode_alone: ClassVar[bool] = False
    # SGLang 0.5.23 managers/scheduler.py `get_next_batch_to_run`: with prefill work a step is a
    # prefill step (enable_mixed_chunk off by default); the decodes wait
    decodes_beside_prefill: ClassVar[bool] = False
    checks_token_ids: ClassVar[bool] = False  # its embedding lookup raises, the server exits
    prefill_bootstrap: ClassVar[bool] = True
    kv_events_format: ClassVar[Literal["vllm", "sglang"]] = "sglang"
    health_path: ClassVar[str] = "/health"
    # /v1/loads is the scheduler's live snapshot (SGLang >= 0.5.x; 0.5.23 no longer serves
    # /get_load); its /metrics gauges appear only once the scheduler has logged stats and are
    # refreshed at log intervals, so they are the fallback for older servers.
    load_paths: ClassVar[tuple[str, ...]] = ("/v1/loads", "/metrics")
    info_paths: ClassVar[tuple[str, ...]] = ("/v1/models", "/server_info")

    # -- bodies ---------------------------------------------------------------------------

    def _rid_pair(self, req: ParsedRequest, request_id: str, unique: int) -> bytes:
        """`"rid":"<unique, 16 hex>-<request id>"`: the name the gateway aborts the request by
        (/abort_request), unique per upstream request and never a prefix of another's (see the
        module's docstring); b"" for batches and n > 1, which SGLang names item by item itself
        (closing the connection aborts them)."""
        if req.is_batch or req.n > 1:
            return b""
        sent = _sent_here(req)
        last = sent.get(request_id)
        if last.__class__ is tuple and last[0] == unique:  # the decode leg of the prefill leg just built
            return last[1]
        pair = b'"rid":"%016x-' % (unique & _MASK) + _body.encoder.encode(request_id)[1:]
        sent[request_id] = (unique, pair)
        return pair

    def _client_rid(self, req: ParsedRequest, request_id: str, unique: int) -> bytes | None:
        """The client's own `rid` (a string, or one per batch item) with the unique part in front,
        as JSON; None to send it as it came (not a name SGLang takes: it refuses it itself).
        The client's name stays readable in the engine's logs and answers (not where the gateway
        splits the request: P/D batches and `n > 1` are units the gateway names, samples.py),
        but two clients, or a retry of this request, never hand the engine the same rid or one
        that extends another."""
        try:
            v = msgspec.json.decode(req.fields.rid)
        except msgspec.DecodeError:
            return None
        head = f"{unique & _MASK:016x}-"
        if isinstance(v, str):
            if not (req.is_batch or req.n > 1):  # a batch's items are named rid_0, rid_1, ...
                _sent_here(req)[request_id] = head + v
            return _body.encoder.encode(head + v)
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return _body.encoder.encode([head + x for x in v])
        return None

    def colocated_body(self, req: ParsedRequest, request_id: str) -> bytes:
        unique = next(_sequence)
        if req.fields.rid:
            named = self._client_rid(req, request_id, unique)
            set_ = {"rid": named} if named is not None else None
            return _body.rewrite(req.decode_dict(), drop=_OWNED, set_=set_)
        rid = self._rid_pair(req, request_id, unique)
        if req.has_owned_fields:
            fields = req.decode_dict()
            return _body.splice(_body.rewrite(fields, drop=_OWNED_RID), rid)
        return _body.splice(req.body, rid)

    def _pd_body(self, req: ParsedRequest, ctx: HandoffCtx, *, prefill: bool = False) -> bytes:
        extra = _bootstrap_prefix(ctx.prefill.url, ctx.prefill.bootstrap_port) + b"%d" % ctx.room
        # Both legs of the handoff get the same rid, its unique part the handoff's room (they go
        # to different servers; a retry has another room).
        set_: dict[str, bytes] | None = None
        drop: tuple[str, ...] = _OWNED_RID
        if req.fields.rid:
            drop = _OWNED  # a rid the gateway cannot rename goes as sent (the engine judges it)
            named = self._client_rid(req, ctx.request_id, ctx.room)
            if named is not None:
                set_ = {"rid": named}
        else:
            rid = self._rid_pair(req, ctx.request_id, ctx.room)
            if rid:
                extra += b"," + rid
        if prefill and req.stream:
            # The prefill's answer is read whole and judged, never relayed: asking for it whole
            # gives one JSON document with the sampled token instead of SSE, and an over-long
            # prompt comes back as a 400 rather than a 200 with an abort event.
            fields = req.decode_dict()
            set_ = {**(set_ or {}), "stream": b"false"}
            return _body.splice(_body.rewrite(fields, drop=(*drop, "stream_options"), set_=set_), extra)
        if req.has_owned_fields or set_ is not None:
            body = _body.splice(_body.rewrite(req.decode_dict(), drop=drop, set_=set_), extra)
        else:
            body = _body.splice(req.body, extra)
        if ctx.stream_usage and not prefill:
            # SGLang sends continuous_usage_stats' per-chunk usage whether or not include_usage
            # is set: forcing it on adds only the final usage chunk, which is dropped
            return _body.ask_stream_usage(body, keep_continuous=True)
        return body

    def summarize(self, req: ParsedRequest, payloads: Iterable[bytes]) -> Summary:
        if req.route is _GENERATE:
            return summarize_generate(payloads)
        return summarize_openai(payloads)

    def supports_pd(self, req: ParsedRequest) -> bool:
        return True

    def split_units(self, req: ParsedRequest) -> list[ParsedRequest]:
        # 0.5.23 gives all samples of a request one bootstrap room: n > 1 hangs in P/D
        return split_units(req)

    def prefill_body(self, req: ParsedRequest, ctx: HandoffCtx) -> bytes:
        return self._pd_body(req, ctx, prefill=True)

    def decode_body(self, req: ParsedRequest, ctx: HandoffCtx, prefill: PrefillVerdict | None) -> bytes:
        return self._pd_body(req, ctx)

    def handoff_bodies(self, req: ParsedRequest, ctx: HandoffCtx) -> tuple[bytes, bytes]:
        if not req.stream:  # the same body to both (the prefill is asked for a whole answer anyway)
            body = self._pd_body(req, ctx)
            return body, body
        return self._pd_body(req, ctx, prefill=True), self._pd_body(req, ctx)

    # -- judging the prefill --------------------------------------------------------------

    def judge_prefill(self, req: ParsedRequest, ctx: HandoffCtx, status: int, body: bytes) -> PrefillVerdict:
        v = self._judge_prefill(req, status, body)
        if not v.ok and b"KVTransferError" in body:
            # "Prefill bootstrap/transfer failed ... KVTransferError(bootstrap_room=N): ..." (a 500
            # abort: disaggregation/prefill.py handle_bootstrap_failure and
            # handle_inflight_transfer_failure): the decode's side may be the one that failed
            return msgspec.structs.replace(v, handoff=True, retryable=True)
        return v

    def _judge_prefill(self, req: ParsedRequest, status: int, body: bytes) -> PrefillVerdict:
        if status != 200:
            return prefill_refused(status, body)
        payloads = list(_body.iter_sse_data(body)) if body.lstrip().startswith(b"data:") else [body]
        if not payloads:
            return PrefillVerdict(ok=False, reason="prefill answered an empty body", status=502)
        cached: CachedTokens | None = None
        for payload in payloads:
            try:
                if req.route is _GENERATE:
                    outs = _gen_dec.decode(payload)
                    for j, out in enumerate(outs if isinstance(outs, list) else [outs]):
                        if j == 0 and out.meta_info is not None and out.meta_info.cached_tokens is not None:
                            cached = from_meta(out.meta_info.cached_tokens, out.meta_info.prompt_tokens)
                        fr = out.meta_info.finish_reason if out.meta_info else None
                        if fr is not None and fr.type == "abort":
                            code = fr.status_code or 500
                            return PrefillVerdict(
                                ok=False,
                                reason=f"prefill aborted the request: {fr.message or 'no reason given'}",
                                retryable=code >= 500,
                                status=code,
                                body=payload,
                            )
                else:
                    o = _oai_dec.decode(payload)
                    if o.error or o.object == "error":
                        return PrefillVerdict(
                            ok=False, reason="prefill sent an error event", status=500, body=payload
                        )
                    for c in o.choices or ():
                        if c.finish_reason == "abort":
                            return PrefillVerdict(ok=False, reason="prefill aborted the request", status=500)
                    if o.usage is not None:
                        cached = from_usage(o.usage)
            except msgspec.DecodeError:
                return PrefillVerdict(ok=False, reason="prefill answered a body that is not JSON", status=502)
        return PrefillVerdict(ok=True, cached=cached)

    def answer_cached(self, req: ParsedRequest, data: bytes, *, stream: bool) -> CachedTokens | None:
        if req.route is not _GENERATE:
            return super().answer_cached(req, data, stream=stream)
        return stream_cached(data, generate=True) if stream else generate_cached(data)

    def decode_transformer(self, req: ParsedRequest, prefill_body: bytes) -> Callable[[bytes], bytes] | None:
        # Only the prefill scored the prompt: with return_logprob its input logprobs are merged in.
        if not (req.return_logprob and req.route is _GENERATE):
            return None
        if not req.stream:
            return lambda body: _merge_bodies(prefill_body, body)
        metas: dict[int, dict[str, object]] = {}
        try:  # the prefill was asked for a whole answer: one object, or a list for batches
            out = msgspec.json.decode(prefill_body)
        except msgspec.DecodeError:
            out = None
        for i, ev in enumerate(out if isinstance(out, list) else [out]):
            if isinstance(ev, dict) and isinstance(ev.get("meta_info"), dict):
                metas[i] = ev["meta_info"]
        return _SSELogprobMerge(metas)

    def abort_call(self, req: ParsedRequest, request_id: str) -> tuple[str, bytes] | None:
        """`/abort_request` naming the rid last sent for this request under `request_id` (the failed
        attempt's legs'); None where none was sent (closing the connection is then the abort)."""
        if req.is_batch or req.n > 1:
            return None
        sent = req.engine_rids
        name = sent.get(request_id) if sent is not None else None
        if name is None:
            return None
        if isinstance(name, tuple):
            return "/abort_request", b"{" + name[1] + b"}"
        return "/abort_request", _body.encoder.encode({"rid": name})

    # -- load and info ----------------------------------------------------------------------

    def parse_load(self, path: str, body: bytes) -> WorkerLoad | None:
        if path == "/v1/loads":
            return _load_from_snapshot(body)
        m = sum_metrics(
            body.decode("utf-8", "replace"),
            (
                "sglang:num_running_reqs",
                "sglang:num_queue_reqs",
                "sglang:num_prefill_inflight_queue_reqs",
                "sglang:num_decode_prealloc_queue_reqs",
                "sglang:num_decode_transfer_queue_reqs",
                "sglang:token_usage",
                "sglang:cache_hit_rate",
            ),
        )
        if "sglang:num_running_reqs" not in m:
            return None  # the scheduler has not logged stats yet: a missing gauge is not a zero
        waiting = (
            m.get("sglang:num_queue_reqs", 0.0)
            + m.get("sglang:num_decode_prealloc_queue_reqs", 0.0)
            + m.get("sglang:num_decode_transfer_queue_reqs", 0.0)
        )
        return WorkerLoad(
            running=int(m["sglang:num_running_reqs"] + m.get("sglang:num_prefill_inflight_queue_reqs", 0.0)),
            waiting=int(waiting),
            kv_usage=m.get("sglang:token_usage", 0.0),
            cache_hit_rate=m.get("sglang:cache_hit_rate", 0.0),
        )

    def parse_info(self, path: str, body: bytes, into: ProbeInfo) -> ProbeInfo:
        if path == "/v1/models":
            return apply_models(body, into)
        if path == "/server_info":
            info = msgspec.json.decode(body, type=_ServerInfo)
            return msgspec.structs.replace(
                into,
                context_length=info.context_length or into.context_length,
                max_input_len=info.max_req_input_len,
                disaggregation_mode=info.disaggregation_mode,
                bootstrap_port=info.disaggregation_bootstrap_port,
                kv_capacity_tokens=info.max_total_num_tokens or into.kv_capacity_tokens,
            )
        return into


class _DisaggLoad(msgspec.Struct):
    prefill_inflight_queue_reqs: int = 0


class _RankLoad(msgspec.Struct):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    token_usage: float = 0.0
    cache_hit_rate: float = 0.0
    disaggregation: _DisaggLoad | None = None


class _Loads(msgspec.Struct):
    loads: list[_RankLoad]


_loads_decoder = msgspec.json.Decoder(_Loads)


def _load_from_snapshot(body: bytes) -> WorkerLoad | None:
    """`GET /v1/loads`: one entry per DP rank; counts add up, usage and hit rate average.

    SGLang already counts its P/D queues (prefill bootstrap; decode prealloc, transfer and
    retracted) in `num_waiting_reqs`; a prefill's requests whose KV is still being sent sit in
    neither count, so they are added to the running ones."""
    try:
        ranks = _loads_decoder.decode(body).loads
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not ranks:
        return None
    running = waiting = 0
    for r in ranks:
        running += r.num_running_reqs
        waiting += r.num_waiting_reqs
        if r.disaggregation is not None:
            running += r.disaggregation.prefill_inflight_queue_reqs
    return WorkerLoad(
        running=running,
        waiting=waiting,
        kv_usage=sum(r.token_usage for r in ranks) / len(ranks),
        cache_hit_rate=sum(r.cache_hit_rate for r in ranks) / len(ranks),
    )


def _merge_bodies(prefill_body: bytes, decode_body: bytes) -> bytes:
    try:
        p = msgspec.json.decode(prefill_body)
        d = msgspec.json.decode(decode_body)
    except msgspec.DecodeError:
        return decode_body
    pairs = zip(p, d, strict=False) if isinstance(p, list) and isinstance(d, list) else [(p, d)]
    for pi, di in pairs:
        if isinstance(pi, dict) and isinstance(di, dict):
            merge_input_logprobs(pi.get("meta_info") or {}, di.get("meta_info") or {})
    return _body.encoder.encode(d)


class _SSELogprobMerge:
    """Rewrites each `data:` event of a decode stream with the prefill's prompt logprobs."""

    def __init__(self, prefill_metas: dict[int, dict[str, object]]) -> None:
        self._metas = prefill_metas
        self._buf = b""

    def __call__(self, data: bytes) -> bytes:
        self._buf += data
        out = []
        while (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[: end + 2], self._buf[end + 2 :]
            out.append(self._rewrite(event))
        return b"".join(out)

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            ev = msgspec.json.decode(event[6:])
        except msgspec.DecodeError:
            return event
        meta = ev.get("meta_info") if isinstance(ev, dict) else None
        pmeta = self._metas.get(int(ev.get("index", 0))) if isinstance(ev, dict) else None
        if not isinstance(meta, dict) or pmeta is None:
            return event
        merge_input_logprobs(pmeta, meta)
        return b"data: " + _body.encoder.encode(ev) + b"\n\n"


def merge_input_logprobs(prefill_meta: dict[str, object], decode_meta: dict[str, object]) -> None:
    """Give the decode's meta_info the prompt logprobs only the prefill computed.

    The prefill scored the whole prompt; the decode knows at most its last position. The merge
    keeps the prefill's list and appends only decode entries past its end, so no position is
    counted twice (sglang-router 0.3.2 prepends and duplicates the decode's first entry).
    """
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        p = prefill_meta.get(key)
        d = decode_meta.get(key)
        if isinstance(p, list) and p:
            tail = d[len(p) :] if isinstance(d, list) else []
            decode_meta[key] = p + tail
