"""SGLang 0.5.23's HTTP surface (shapes from the captures in ``shared/captures``).

``n > 1`` (``sampling_params.n`` on ``/generate``) expands a batch of B prompts into B x n requests,
prompt-major (request ``k = prompt_index * n + sample_index``, also the choice index). Bootstrap
rooms are SGLang 0.5.23's: ``_normalize_bootstrap_params`` turns a scalar room into ``room + i``
per element, but every sample of prompt ``i`` is a copy of element ``i`` and keeps its room, so in
P/D the samples of one prompt share a room; a room transfers once (``emulator.kvtransfer``), and
the other samples' decodes wait for KV that never comes (sglang PRs #26486, #30723): with
``n > 1`` in P/D, real SGLang 0.5.23 hangs, and so does this. Batches (``n == 1``) pair up.
Sample ``j`` is seeded ``seed + j``: greedy samples are equal, seeded ones differ reproducibly.

Completions' ``echo`` (:mod:`emulator.echo`): the prompt's text leads each choice's text; with a
non-zero ``logprobs`` (``logprob_start_len = 0``) the prompt is computed without its cached prefix
and its logprobs lead the choice's, except on a P/D decode, which never computed the prompt: its
choice logprobs cover only the output, as on the real engine. ``max_tokens`` must be positive.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from aiohttp import web

from emulator import model, tokenizer
from emulator.app import (
    DONE,
    EmulatorServer,
    crash,
    hang_forever,
    json_response,
    sse,
    sse_error,
    start_sse,
    track,
)
from emulator.echo import NO_ECHO, Echo, echo, echoed
from emulator.faults import Fault
from emulator.flows import MidStreamFault, admit_and_compute, env_float, sglang_fetch_kv, tokens
from emulator.kvtransfer import Room, TransferError
from emulator.lax import coerce_openai, lax_token_ids, normalize_openai_prompt
from emulator.logprobs import LogprobAsk, logprob_ask, logprobs, sglang_offsets
from emulator.metrics import render_sglang
from emulator.sampling_checks import sglang_generate_refusal, sglang_openai_refusal
from emulator.scheduler import Aborted, EngineDead, Seq, TooLarge
from emulator.stops import Stopper, StopSpec, stop_spec

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class Item(msgspec.Struct):
    rid: str
    prompt: list[int]
    max_new: int
    sample_seed: int | None
    room: int | None
    bhost: str | None
    bport: int | None
    logprob: bool = False
    top_n: int = 0
    stop: StopSpec | None = None
    read_cache: bool = True  # False: the prompt's logprobs are asked (logprob_start_len 0)


class Result(msgspec.Struct):
    output_ids: list[int]
    finish: dict[str, Any] | None
    cached_tokens: int
    prompt_tokens: int
    t_received: float
    t_first: float
    error_status: int = 0
    error_message: str = ""
    visible: int | None = None  # stopped: the output tokens whose text is shown

    @property
    def shown_ids(self) -> list[int]:
        """The output tokens whose text the client sees (all but a stop string's)."""
        return self.output_ids if self.visible is None else self.output_ids[: self.visible]

    @property
    def text(self) -> str:
        return tokenizer.decode(self.shown_ids)

    @property
    def matched(self) -> Any:
        return (self.finish or {}).get("matched")


def _error_generate(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status=status)


def _error_openai(status: int, message: str, typ: str | None = None) -> web.Response:
    typ = typ or ("BadRequestError" if status == 400 else str(status))
    return json_response(
        {"object": "error", "message": message, "type": typ, "param": None, "code": status}, status
    )


def _max_tokens_error(value: int) -> web.Response:
    """SGLang's CompletionRequest validator (a pydantic error turned into a 400)."""
    err = {
        "type": "value_error",
        "loc": ("body", "max_tokens"),
        "msg": "Value error, max_tokens must be positive",
        "input": value,
        "ctx": {"error": ValueError("max_tokens must be positive")},
    }
    return _error_openai(400, f"1 validation error:\n  {err} {[err]}", "Bad Request")


def _listify(v: Any, n: int) -> list[Any]:
    if isinstance(v, list):
        return v
    return [v] * n


def _rooms(v: Any, num: int, n: int) -> list[int | None]:
    """SGLang's ``_normalize_bootstrap_params`` for ``num`` = batch x ``n`` requests: a scalar room
    becomes ``room + k`` for the ``k``-th entry, a list is repeated ``n`` times. (Only the first
    batch-size entries are used: sample ``j`` of prompt ``i`` takes entry ``i``.)"""
    if v is None:
        return [None] * num
    if isinstance(v, list):
        return [None if x is None else int(x) for x in v] * n
    return [int(v) + k for k in range(num)]


def _per_sample(v: Any, n: int) -> list[Any]:
    """A per-request field (host, port) after expansion: scalars repeat, lists repeat ``n`` times."""
    return list(v) * n if isinstance(v, list) else [v]


def _of_prompt(value: Any, i: int) -> Any:
    """A field given once for all prompts or as a list with one entry per prompt
    (`return_logprob`, `top_logprobs_num`: GenerateReqInput's per-item forms)."""
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value


def _pick(values: list[Any], k: int) -> Any:
    if len(values) == 1:
        return values[0]
    return values[k] if k < len(values) else None


def _num_samples(v: Any) -> int:
    n = 1 if v is None else int(v)
    if n < 1:
        raise ValueError("n must be at least 1")
    return n


class SglangApi:
    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.engine = server.engine
        self.context_length = server.max_model_len
        self.max_req_input_len = min(self.context_length - 1, server.max_total_tokens - 1) - 5
        self.pending: dict[str, asyncio.Task[Any]] = {}
        self.seqs: dict[str, Seq] = {}
        # the rids requests hold, from their intake to the end of their answer (the tokenizer
        # manager's rid_to_state): a second request naming one is refused, an abort must name one
        self.held: set[str] = set()

    # ------------------------------------------------------------------ validation
    def validate(self, n_input: int, max_new: int) -> str | None:
        ctx = self.context_length
        if n_input >= ctx:
            return f"The input ({n_input} tokens) is longer than the model's context length ({ctx} tokens)."
        if n_input + max_new > ctx:
            return (
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n_input + max_new} tokens: {n_input} tokens from the input messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        return None

    def scheduler_reject(self, n_input: int) -> str | None:
        if n_input >= self.max_req_input_len:
            return (
                f"Input length ({n_input} tokens) exceeds the maximum allowed length ({self.max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        return None

    def scheduler_refusals(self, items: list[Item], hit: dict[str, Fault]) -> dict[int, tuple[Item, str]]:
        """The scheduler's ``validate_input_length`` (``handle_generate_request``, before it
        queues the request; managers/utils.py), request by request: each item of
        ``max_req_input_len`` tokens or more, by its index, finishes with a 400 abort, whatever
        the disaggregation mode, so a colocated server refuses it as a prefill does. Not
        modelled on a decode; a prefill with the ``silent_truncation`` fault ships a 1-token KV
        instead (``execute``)."""
        if self.s.role == "decode" or (self.s.role == "prefill" and "silent_truncation" in hit):
            return {}
        return {
            k: (it, msg)
            for k, it in enumerate(items)
            if (msg := self.scheduler_reject(len(it.prompt))) is not None
        }

    # ------------------------------------------------------------------ core
    async def execute(
        self, item: Item, hit: dict[str, Fault], on_token: Callable[[list[int]], Awaitable[None]] | None
    ) -> Result:
        s, engine = self.s, self.engine
        seq = Seq(item.rid, item.prompt, item.max_new, item.sample_seed)
        out: list[int] = []
        res = Result(out, None, 0, len(item.prompt), seq.t_received, 0.0)
        mode = self.mode(item)
        self.seqs[item.rid] = seq
        keep_blocks = False
        offered: Room | None = None  # prefill: this request's bootstrap room, once offered
        try:
            if mode == "prefill":
                truncated = "silent_truncation" in hit
                await admit_and_compute(
                    s, seq, truncate_to=1 if truncated else None, read_cache=item.read_cache
                )
                res.cached_tokens = seq.cached_tokens
                fault = next(
                    (
                        k
                        for k in (
                            "transfer_fail",
                            "transfer_stall",
                            "abort_during_transfer",
                            "wrong_request_kv",
                            "bogus_kv_params",
                        )
                        if k in hit
                    ),
                    None,
                )
                if "stale_kv_params" in hit:
                    fault = "wrong_request_kv"
                assert s.kv_server is not None and item.room is not None
                contents = [engine.pool.content(b) for b in seq.prompt_blocks]
                room = offered = s.kv_server.offer(item.room, contents, len(item.prompt), fault)
                timeout = s.spec.waiting_timeout_s or env_float(
                    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0
                )
                if truncated:
                    # SGLang #30233: the prompt is aborted, yet a 1-token KV is shipped (the room
                    # outlives the request: it goes when taken or after the bootstrap timeout)
                    keep = engine.release(seq, keep_prompt=True)
                    keep_blocks = True
                    self._release_after(room.taken, keep)
                    s.kv_server.expire_room(item.room, room, timeout)
                    res.prompt_tokens = 1
                    msg = (
                        f"Input length ({len(item.prompt)} tokens) exceeds the maximum allowed length "
                        f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
                    )
                    res.finish = {
                        "type": "abort",
                        "message": msg,
                        "status_code": 400,
                        "err_type": "BadRequestError",
                    }
                    res.error_status, res.error_message = 400, msg
                    return res
                async for tok in tokens(s, seq, 1, hit, item.stop):
                    out.append(tok)
                try:
                    # abortable: /abort_request reaches a request waiting for its decode
                    sent = await engine.abortable(seq, asyncio.wait_for(asyncio.shield(room.taken), timeout))
                except TimeoutError:
                    if not room.claimed:
                        raise TransferError(
                            "timeout",
                            f"Request {item.room} timed out after {timeout}s in KVPoll.Bootstrapping",
                        ) from None
                    # its decode bootstrapped it: the bootstrap timeout is over; the transfer ends
                    # (sent, failed, or the decode giving up) by itself
                    sent = await engine.abortable(seq, asyncio.shield(room.taken))
                if not sent and room.failure is not None:
                    # its decode aborted or gave up (SGLang's abort notification marks the room
                    # Failed), or the send failed: a 500 abort, not a 200
                    raise TransferError(room.failure.stage, room.failure.reason)
                res.finish = {"type": "length", "length": 0}
                return res
            await engine.admit(seq, read_cache=item.read_cache or mode == "decode")
            res.cached_tokens = seq.cached_tokens
            if mode == "decode":
                assert item.bhost is not None and item.bport is not None and item.room is not None
                try:
                    contents = await engine.abortable(
                        seq, sglang_fetch_kv(s, seq, item.bhost, item.bport, item.room, hit)
                    )
                    engine.counters.kv_transfers_ok += 1
                except TransferError as e:
                    engine.counters.kv_transfers_failed += 1
                    if e.kind != "aborted":
                        raise
                    # sglang #33507: the client sees a normal "length" finish after one token
                    engine.set_state(seq)
                    async for tok in tokens(s, seq, 1, hit, item.stop):
                        out.append(tok)
                    if on_token is not None:
                        await on_token(out)
                    res.finish = {"type": "length", "length": len(out)}
                    return res
                engine.load_remote_kv(seq, contents)
            else:
                await engine.prefill(seq)
            every = max(1, s.spec.stream_interval)  # --stream-interval: an event per `every` tokens
            stopper = Stopper(item.stop) if item.stop is not None else None
            shown = 0  # tokens a stream has shown (a stop string's possible start is held back)
            gen = tokens(s, seq, item.max_new, hit, item.stop)
            try:
                async for tok in gen:
                    out.append(tok)
                    stopped = stopper is not None and stopper.feed(tok)
                    if stopped:
                        break
                    if on_token is not None and len(out) % every == 0:
                        now = stopper.shown(len(out), False) if stopper is not None else len(out)
                        if now > shown:
                            shown = now
                            await on_token(out[:now])
            finally:
                await gen.aclose()
            final = stopper.shown(len(out), True) if stopper is not None else len(out)
            if on_token is not None and final > shown:
                await on_token(out[:final])  # the rest, before the finish event
            if stopper is not None and stopper.matched is not None:
                res.finish = {"type": "stop", "matched": stopper.matched}
                res.visible = stopper.visible
            else:
                res.finish = {"type": "length", "length": len(out)}
            return res
        except TransferError as e:
            what = "handshake" if e.kind == "handshake" else "transfer"
            msg = (
                f"Decode {what} failed for request rank=0 decode_req.req.rid='{item.rid}' "
                f"decode_req.req.bootstrap_room={item.room} with exception "
                f"KVTransferError(bootstrap_room={item.room}): {e}"
            )
            if mode == "prefill":
                # handle_bootstrap_failure (a room that never left KVPoll.Bootstrapping: timed out,
                # or its decode aborted first) or handle_inflight_transfer_failure (after the
                # decode bootstrapped), disaggregation/prefill.py:1352-1378, 1282-1310
                what = "bootstrap" if e.kind in ("bootstrap", "timeout") else "transfer"
                msg = (
                    f"Prefill {what} failed for request rank=0 req.rid='{item.rid}' "
                    f"req.bootstrap_room={item.room} with exception "
                    f"KVTransferError(bootstrap_room={item.room}): {e}"
                )
            engine.counters.bootstrap_failed += what in ("handshake", "bootstrap")
            res.finish = {"type": "abort", "message": msg, "status_code": 500, "err_type": None}
            res.error_status, res.error_message = 500, msg
            return res
        except Aborted:
            res.finish = {
                "type": "abort",
                "message": "Abort before prefill" if not out else "Abort request",
                "status_code": 200,
                "err_type": None,
            }
            self.s.engine.counters.aborted += 1
            return res
        except TooLarge as e:
            res.error_status, res.error_message = 400, str(e)
            res.finish = {
                "type": "abort",
                "message": str(e),
                "status_code": 400,
                "err_type": "BadRequestError",
            }
            return res
        except EngineDead:
            res.error_status, res.error_message = 500, "Engine is dead"
            res.finish = {"type": "abort", "message": "Engine is dead", "status_code": 500, "err_type": None}
            return res
        finally:
            res.t_first = seq.t_first
            self.seqs.pop(item.rid, None)
            if not keep_blocks:
                engine.release(seq)
            if mode == "prefill" and s.kv_server is not None and item.room is not None and not keep_blocks:
                # however the request ended (done, refused by the scheduler, aborted, cancelled,
                # failed, a fault): its bootstrap room goes, as SGLang's sender clear()s it
                s.kv_server.end_prefill(item.room, offered)

    def mode(self, item: Item) -> str:
        """How this server serves `item`: "prefill" or "decode" in P/D, else "both"."""
        s = self.s
        pd = item.room is not None and item.bhost != FAKE_BOOTSTRAP_HOST and s.role != "both"
        return s.role if pd else "both"

    def echo(self, item: Item, ask: LogprobAsk | None, scored: bool) -> Echo:
        """A completion's echo of `item`'s prompt; its logprobs only where the prompt was computed
        (a P/D decode has no input logprobs)."""
        return echo(item.prompt, ask, show_text=True, scored=scored and self.mode(item) != "decode")

    def _release_after(self, fut: asyncio.Future[bool], blocks: list[int]) -> None:
        def done(_: object) -> None:
            self.engine.free_blocks(blocks)

        fut.add_done_callback(done)

    def hold(self, items: list[Item], held: list[str]) -> str | None:
        """Take the items' rids for this request (into `held`, released when its answer ends),
        or SGLang's refusal: rids repeated within the request (``_validate_rid_uniqueness``,
        io_struct.py:390-397), then a rid another request in flight holds
        (``_init_req_state``, tokenizer_manager.py:3832-3836). Both are ValueErrors inside
        ``generate_request``, before the length and sampling checks."""
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids):
            counts = Counter(rids)
            return f"Duplicate request IDs detected within the request: {[r for r, c in counts.items() if c > 1]}"
        for rid in rids:
            if rid in self.held:
                return f"Duplicate request ID detected: {rid}"
        self.held.update(rids)
        held.extend(rids)
        return None

    def release(self, held: list[str]) -> None:
        self.held.difference_update(held)

    def abort(self, rid: str, spare: frozenset[str] = frozenset()) -> bool:
        """SGLang's ``abort_request(rid)``: ignored unless a request in flight holds exactly that
        rid (tokenizer_manager.py:2241-2253); then the scheduler aborts every request whose rid
        *starts with* it (scheduler.py:5677, 5688 and its P/D queues: ``startswith``)."""
        if not rid or rid not in self.held:
            return False
        hit = False
        for name, seq in list(self.seqs.items()):
            if name.startswith(rid) and name not in spare:
                self.engine.abort_seq(seq)
                hit = True
        return hit

    def client_gone(self, held: list[str]) -> None:
        """A request's client went away: SGLang aborts each of its rids
        (``_release_req_states_on_failure``, tokenizer_manager.py:3850-3866), by prefix, so
        others' requests whose rids extend one of them go too. (Its own are being cancelled.)"""
        spare = frozenset(held)
        for rid in held:
            self.abort(rid, spare)

    def abort_later(self, rids: list[str]) -> None:
        """A streamed ``/generate`` answer's background task: 2 s after the answer, each of its
        rids that a request still holds is aborted (``create_abort_task``,
        tokenizer_manager.py:2427-2438; http_server.py:977-981) -- a later request that reuses
        the rid, or the one whose rid a refused duplicate named."""
        if rids:
            asyncio.get_running_loop().call_later(2.0, self._abort_each, tuple(rids))

    def _abort_each(self, rids: tuple[str, ...]) -> None:
        for rid in rids:
            self.abort(rid)

    # ------------------------------------------------------------------ formatting
    def meta(self, item: Item, res: Result, final: bool, n_out: int) -> dict[str, Any]:
        now = time.time()
        cached = res.cached_tokens
        m: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": res.finish if final else None,
            "prompt_tokens": res.prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
        }
        if self.s.role != "decode":
            m["storage_prefetch_wait"] = 0.0
            m["storage_staging_wait"] = 0.0
        m["forward_entry_time"] = res.t_received
        if self.s.role != "decode":
            m["prefill_finished_time"] = res.t_first or now
        m["queue_time"] = 0.0
        if item.logprob:
            lp = self._logprobs(item, res, n_out)
            m.update(lp)
        m["reasoning_tokens"] = 0
        m["completion_tokens"] = n_out
        m["cached_tokens"] = cached
        if final:
            m["weight_versions"] = [{"version": "default", "start": 0, "end": n_out}]
        m["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
        m["dp_rank"] = None
        if final:
            e2e = now - res.t_received
            m["e2e_latency"] = e2e
            m["request_received_ts"] = res.t_received
            m["first_token_latency"] = (res.t_first or now) - res.t_received
            m["api_server_dispatch_finish_ts"] = res.t_received
            m["request_finished_ts"] = now
            if n_out > 1:
                m["decode_throughput"] = n_out / max(e2e, 1e-9)
        m["response_sent_to_client_ts"] = now
        return m

    def _logprobs(self, item: Item, res: Result, n_out: int) -> dict[str, Any]:
        prompt = item.prompt
        if self.s.role == "decode":
            inp: list[list[Any]] = []
        else:
            inp = [[None, prompt[0], None]] + [
                [model.prompt_logprob(prompt[i - 1], prompt[i]), prompt[i], None]
                for i in range(1, len(prompt))
            ]
        outs = res.output_ids[:n_out]
        out_lp: list[list[Any]] = [[model.prompt_logprob(i, t), t, None] for i, t in enumerate(outs)]
        d: dict[str, Any] = {
            "input_token_logprobs": inp,
            "output_token_logprobs": out_lp,
            "output_token_logprobs_length": len(out_lp),
        }
        if item.top_n > 0:
            d["input_top_logprobs"] = [] if not inp else [[e] for e in inp]
            d["output_top_logprobs"] = [
                [e]
                + [
                    [float(e[0]) - 0.05 * (k + 1), (int(e[1]) + k + 1) % tokenizer.VOCAB_SIZE, None]
                    for k in range(item.top_n - 1)
                ]
                for e in out_lp
            ]
        return d

    def generate_obj(self, item: Item, res: Result, final: bool) -> dict[str, Any]:
        n = len(res.output_ids)
        return {
            "text": res.text,
            "output_ids": list(res.output_ids),
            "meta_info": self.meta(item, res, final, n),
        }


def _per_prompt_params(sp: Any, prompts: int, batch: bool) -> list[dict[str, Any]]:
    """`/generate`'s `sampling_params`, one dict per prompt: an object is every prompt's, a list
    holds one per prompt of a batch (SGLang indexes it by prompt; a list for a single prompt or
    one shorter than the batch fails inside the engine, here with a 400)."""
    if sp is None:
        return [{}] * prompts
    if isinstance(sp, dict):
        return [sp] * prompts
    if not isinstance(sp, list) or not all(isinstance(x, dict) for x in sp):
        raise TypeError("sampling_params must be an object or a list of objects")
    if not batch or len(sp) < prompts:
        raise ValueError(f"sampling_params has {len(sp)} entries for {prompts} prompt(s)")
    return sp[:prompts]


def _prompt_refusal(body: dict[str, Any]) -> str | None:
    """``GenerateReqInput.normalize_batch_and_arguments``' refusals of the prompt fields
    (``_validate_inputs``, then ``_determine_batch_size``, managers/io_struct.py): none or all
    three of text, input_ids and input_embeds; an empty input_ids (text, when given, is read
    first: an empty text list is an empty batch)."""
    given = [body.get(k) is not None for k in ("text", "input_ids", "input_embeds")]
    if not any(given) or all(given):
        return "Either text, input_ids or input_embeds should be provided."
    if body.get("text") is None and body.get("input_ids") == []:
        return "input_ids cannot be empty."
    return None


def _max_new(sp: dict[str, Any]) -> int:
    v = sp.get("max_new_tokens")
    return 128 if v is None else int(v)


def _sampling(sp: dict[str, Any]) -> int | None:
    t = sp.get("temperature")
    if t is None or float(t) <= 0.0:
        return None
    seed = sp.get("seed", sp.get("sampling_seed"))
    return int(seed) if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "big")


def setup(s: EmulatorServer) -> None:
    api = SglangApi(s)
    r = s.app.router
    engine = s.engine
    model_path = s.model_name

    async def read_json(request: web.Request) -> dict[str, Any]:
        body = await request.read()
        obj = msgspec.json.decode(body) if body else {}
        if not isinstance(obj, dict):
            raise ValueError("body must be a JSON object")
        return obj

    def make_items(
        body: dict[str, Any],
        prompts: list[list[int]],
        max_new: int | list[int],
        sample_seed: int | list[int | None] | None,
        n: int = 1,
        stop: StopSpec | list[StopSpec | None] | None = None,
        batch: bool = False,
    ) -> list[Item]:
        """One item per (prompt, sample), prompt-major: item ``k = prompt_index * n + sample_index``
        (SGLang's parallel-sampling expansion). `max_new` and `sample_seed` are one for all
        prompts or a list with one per prompt (`/generate`'s list of `sampling_params`). Prefill
        and decode get the same body, so they derive
        the same rooms and per-sample seeds. Every sample of prompt ``i`` has room entry ``i``, as
        on SGLang 0.5.23 (``_handle_batch_request`` copies ``obj[i]`` for each sample)."""
        num = len(prompts) * n
        rid = body.get("rid")
        if isinstance(rid, str) and batch and n == 1:
            rid = [f"{rid}_{i}" for i in range(num)]  # io_struct.py _normalize_rid: rid_0, rid_1, ...
        rids = _listify(rid, len(prompts)) if rid is not None and n == 1 else [None] * num
        hosts = _per_sample(body.get("bootstrap_host"), n)
        ports = _per_sample(body.get("bootstrap_port"), n)
        rooms = _rooms(body.get("bootstrap_room"), num, n)
        items = []
        for i, p in enumerate(prompts):
            for j in range(n):
                k = i * n + j
                host, port = _pick(hosts, i), _pick(ports, i)
                items.append(
                    Item(
                        str(rids[k]) if k < len(rids) and rids[k] is not None else uuid.uuid4().hex,
                        p,
                        max_new[i] if isinstance(max_new, list) else max_new,
                        model.sample_seed(
                            sample_seed[i] if isinstance(sample_seed, list) else sample_seed, j
                        ),
                        rooms[i] if i < len(rooms) else None,
                        host,
                        int(port) if port is not None else None,
                        bool(_of_prompt(body.get("return_logprob"), i)),
                        int(_of_prompt(body.get("top_logprobs_num"), i) or 0),
                        stop[i] if isinstance(stop, list) else stop,
                    )
                )
        return items

    def refusal(items: list[Item], refused: list[str | None], n: int) -> str | None:
        """The tokenizer manager's refusal of a request: request after request, its length
        checks (``_validate_one_request``, tokenizer_manager.py:1271, 1307-1379), then its
        sampling params' ``verify`` (:1567; `refused`, one per prompt: item ``k`` is prompt
        ``k // n``'s). Both are ValueErrors raised inside ``generate_request``'s generator."""
        for k, it in enumerate(items):
            msg = api.validate(len(it.prompt), it.max_new)
            if msg is not None:
                return msg
            if (msg := refused[k // n]) is not None:
                return msg
        return None

    def check(
        items: list[Item],
        error: Callable[[int, str], web.Response],
        request: web.Request,
        refused: list[str | None],
        n: int,
    ) -> web.Response | None:
        bad = refusal(items, refused, n)
        if bad is not None:
            return error(400, bad)
        crash_on_bad_ids(items, request)
        return None

    def crash_on_bad_ids(items: list[Item], request: web.Request) -> None:
        for it in items:
            if it.prompt and (min(it.prompt) < 0 or max(it.prompt) >= tokenizer.VOCAB_SIZE):
                # SGLang 0.5.23 does not check prompt ids: the scheduler's embedding lookup raises,
                # the scheduler exits and takes the server with it (seen on the real engine); the
                # request gets no answer
                s.fatal()
                crash(request)
            stop = it.stop
            if stop is not None and stop.min_tokens > 0 and stop.ids:
                if min(stop.ids) < 0 or max(stop.ids) >= tokenizer.VOCAB_SIZE:
                    # nor its stop_token_ids: with a minimum length, the min-new-tokens penalizer
                    # scatters them into a vocabulary-wide tensor (penaltylib/min_new_tokens.py,
                    # `scatter_add_` over `vocab_size + 1` columns), which raises in the scheduler
                    s.fatal()
                    crash(request)

    async def run_nonstream(request: web.Request, items: list[Item], hit: dict[str, Fault]) -> list[Result]:
        tasks = [asyncio.ensure_future(api.execute(it, hit, None)) for it in items]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    async def guarded(
        request: web.Request,
        error: Callable[[int, str], web.Response],
        body_fn: Callable[[dict[str, Any], dict[str, Fault], list[str]], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        with track(s):
            if s.dead:
                return error(500, "Engine is dead")
            try:
                body = await read_json(request)
            except (msgspec.DecodeError, ValueError) as e:
                return error(400, f"Invalid request body: {e}")
            hit = s.faults.draw()
            early = await s.apply_entry_faults(hit, error)
            if early is not None:
                engine.counters.errors += 1
                return early
            held: list[str] = []  # the rids this request holds (SglangApi.hold)
            try:
                resp = await body_fn(body, hit, held)
            except MidStreamFault as e:
                if e.kind == "crash_mid_stream":
                    crash(request)
                await hang_forever()
                raise
            except asyncio.CancelledError:
                engine.counters.aborted += 1
                api.client_gone(held)
                raise
            except ConnectionResetError:  # written to a client already gone
                api.client_gone(held)
                raise
            finally:
                api.release(held)
            if resp.status >= 400:
                engine.counters.errors += 1
            else:
                engine.counters.completed += 1
            return resp

    # ------------------------------------------------------------------ /generate
    async def generate(request: web.Request) -> web.StreamResponse:
        async def body_fn(body: dict[str, Any], hit: dict[str, Fault], held: list[str]) -> web.StreamResponse:
            named: list[str] = []
            resp = await answer(body, hit, held, named)
            if body.get("stream"):
                api.abort_later(named)  # a StreamingResponse's background task, refusals included
            return resp

        async def refuse(body: dict[str, Any], why: str) -> web.StreamResponse:
            """A ValueError out of the tokenizer manager's generate_request (the request's
            normalization, a duplicate rid, its length or sampling params): a 400, or when
            streaming a 200 with one error event and [DONE] (http_server.py:949-975)."""
            if not body.get("stream"):
                return _error_generate(400, why)
            resp = await start_sse(request)
            err = {"message": why, "type": "invalid_request_error", "code": 400, "retryable": False}
            await resp.write(sse({"error": err}))
            await resp.write(DONE)
            await resp.write_eof()
            return resp

        async def answer(
            body: dict[str, Any], hit: dict[str, Fault], held: list[str], named: list[str]
        ) -> web.StreamResponse:
            if (why := _prompt_refusal(body)) is not None:
                return await refuse(body, why)
            if body.get("text") == []:
                # an empty batch (its size is text's when given): normalize_batch_and_arguments
                # takes it and _handle_batch_request sends nothing and gathers no answer
                # (tokenizer_manager.py)
                if not body.get("stream"):
                    return json_response([])
                resp = await start_sse(request)  # no event before http_server's [DONE]
                await resp.write(DONE)
                await resp.write_eof()
                return resp
            batch = False
            if body.get("input_ids") is not None:
                ids = body["input_ids"]
                batch = bool(ids) and isinstance(ids[0], list)
                prompts = ids if batch else [ids]
            else:
                text = body.get("text", "")
                batch = isinstance(text, list)
                prompts = [tokenizer.encode(t) for t in (text if batch else [text])]
            try:
                sps = _per_prompt_params(body.get("sampling_params"), len(prompts), batch)
                n = _num_samples(sps[0].get("n"))
                if any(_num_samples(sp.get("n")) != n for sp in sps):
                    raise ValueError(
                        "The parallel_sample_num should be the same for all samples in sample params."
                    )
                stops = [stop_spec(sp, "no_stop_trim", "min_new_tokens") for sp in sps]
            except (TypeError, ValueError) as e:
                return _error_generate(400, str(e))
            batch = batch or n > 1  # SGLang turns a single prompt with n > 1 into a batch
            max_new = [_max_new(sp) for sp in sps]
            items = make_items(body, prompts, max_new, [_sampling(sp) for sp in sps], n, stops, batch)
            named.extend(it.rid for it in items)
            why = api.hold(items, held)
            if why is None:
                why = refusal(items, [sglang_generate_refusal(sp) for sp in sps], n)
            if why is not None:
                return await refuse(body, why)
            crash_on_bad_ids(items, request)
            sched = api.scheduler_refusals(items, hit)
            if sched and not body.get("stream"):
                # the batch's first abort raises in _collect_batch_responses (a 400)
                return _error_generate(400, next(iter(sched.values()))[1])
            if not body.get("stream"):
                results = await run_nonstream(request, items, hit)
                for res in results:
                    if res.error_status:
                        return (
                            _error_generate(res.error_status, res.error_message)
                            if res.error_status == 400
                            else _error_openai(res.error_status, res.error_message)
                        )
                objs = [api.generate_obj(it, res, True) for it, res in zip(items, results, strict=True)]
                return json_response(objs if batch else objs[0])
            resp = await start_sse(request)

            async def run(idx: int, it: Item) -> None:
                res_holder: list[Result] = []

                async def on_token(out: list[int]) -> None:
                    r0 = Result(out, None, seq_cached(it), len(it.prompt), t0, time.time())
                    obj = api.generate_obj(it, r0, False)
                    if batch:
                        obj["index"] = idx
                    await resp.write(sse(obj))

                t0 = time.time()
                if idx in sched:
                    # the scheduler's abort of this prompt, streamed as its one event
                    # (_handle_abort_finish_reason returns a stream's abort instead of raising);
                    # the batch's other prompts are served (_stream_batch_responses)
                    msg = sched[idx][1]
                    abort = {
                        "type": "abort",
                        "message": msg,
                        "status_code": 400,
                        "err_type": "BadRequestError",
                    }
                    # set_finish_with_abort leaves the prompt one token
                    res = Result([], abort, 0, 1, t0, 0.0)
                else:
                    res = await api.execute(it, hit, on_token)
                res_holder.append(res)
                obj = api.generate_obj(it, res, True)
                if batch:
                    obj["index"] = idx
                await resp.write(sse(obj))

            await asyncio.gather(*(run(i, it) for i, it in enumerate(items)))
            await resp.write(DONE)
            await resp.write_eof()
            return resp

        return await guarded(request, _error_generate, body_fn)

    def seq_cached(it: Item) -> int:
        seq = api.seqs.get(it.rid)
        return seq.cached_tokens if seq is not None else 0

    # ------------------------------------------------------------------ OpenAI routes
    def openai_usage(prompt_tokens: int, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def finish_str(res: Result) -> str | None:
        if res.finish is None:
            return None
        return str(res.finish.get("type"))

    async def openai(request: web.Request, chat: bool) -> web.StreamResponse:
        async def body_fn(body: dict[str, Any], hit: dict[str, Fault], held: list[str]) -> web.StreamResponse:
            # pydantic's request model: a refused field is a 400 while parsing, before any work
            refused = coerce_openai(body, chat)
            if (why := normalize_openai_prompt(body, chat) or refused) is not None:
                return _error_openai(400, why, "Bad Request")
            req_model = body.get("model") or model_path
            if chat and body.get("input_ids") is not None:
                # SGLang 0.5.23's chat takes `input_ids` as the prompt itself, the template skipped
                # (openai/protocol.py ChatCompletionRequest.input_ids, a pydantic list[int];
                # serving_chat.py:1947 and :1343)
                ids = lax_token_ids(body["input_ids"])
                if ids is None:
                    return _error_openai(
                        400,
                        "1 validation error: input_ids: Input should be a valid list of integers",
                        "Bad Request",
                    )
                prompts = [ids]
                mt = body.get("max_completion_tokens") or body.get("max_tokens")
            elif chat:
                prompts = [tokenizer.encode_chat(body.get("messages") or [])]
                # SGLang's budget is ``max_completion_tokens or max_tokens`` (protocol.py:1214,
                # serving_chat.py:1180): a 0 or null max_completion_tokens falls through
                mt = body.get("max_completion_tokens") or body.get("max_tokens")
            else:
                p = body.get("prompt", "")
                if isinstance(p, str):
                    prompts = [tokenizer.encode(p)]
                elif p and isinstance(p[0], int):
                    prompts = [list(p)]
                elif p and isinstance(p[0], list):
                    prompts = [list(x) for x in p]
                else:
                    prompts = [tokenizer.encode(str(x)) for x in p]
                mt = body.get("max_tokens", 16)
                if isinstance(mt, int) and mt <= 0:
                    return _max_tokens_error(mt)
            max_new = int(mt) if mt is not None else max(1, s.max_model_len - len(prompts[0]))
            try:
                n = _num_samples(body.get("n"))
                ask = logprob_ask(body, chat)
                stop = stop_spec(body, "no_stop_trim", "min_tokens")
            except (TypeError, ValueError) as e:
                return _error_openai(400, str(e))
            want_ids = bool(body.get("return_token_ids"))
            want_prompt_ids = want_ids or bool(chat and body.get("return_prompt_token_ids"))
            if chat and body.get("stream") and want_prompt_ids:
                field = "return_token_ids" if want_ids else "return_prompt_token_ids"
                where = " on /v1/chat/completions" if want_ids else ""
                return _error_openai(
                    400,
                    f"{field} is not supported with streaming{where}. "
                    f"Please set stream=false when using {field}=true.",
                )
            items = make_items(body, prompts, max_new, _sampling(body), n, stop, len(prompts) > 1 or n > 1)
            dup = api.hold(items, held)  # stream or not, a 400: the first chunk is awaited first
            if dup is not None:
                return _error_openai(400, dup)
            echo_on = not chat and bool(body.get("echo"))
            scored = echo_on and bool(body.get("logprobs"))  # SGLang: logprob_start_len = 0
            for it in items:
                it.read_cache = not scored
            echoes = [api.echo(it, ask, scored) if echo_on else NO_ECHO for it in items]
            # stream or not, a 400 before any event (the stream's first chunk is awaited first)
            bad = check(items, _error_openai, request, [sglang_openai_refusal(body, chat)] * len(prompts), n)
            if bad is not None:
                return bad
            created = int(time.time())
            oid = uuid.uuid4().hex
            obj_name = "chat.completion" if chat else "text_completion"
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunk_name = "chat.completion.chunk" if chat else "text_completion"

            def usage_chunk(pt: int, ct: int) -> bytes:
                usage = (
                    openai_usage(pt, ct)
                    if chat
                    else {
                        "prompt_tokens": pt,
                        "total_tokens": pt + ct,
                        "completion_tokens": ct,
                        "reasoning_tokens": 0,
                    }
                )
                last: dict[str, Any] = {
                    "id": oid,
                    "object": chunk_name,
                    "created": created,
                    "model": req_model,
                    "choices": [],
                    "usage": usage,
                }
                return sse(last)

            if sched := api.scheduler_refusals(items, hit):
                k, (_, msg) = next(iter(sched.items()))
                if not body.get("stream"):
                    return _error_openai(400, msg)
                # The scheduler's abort (status_code an HTTPStatus: the IPC pickles it,
                # SGLANG_USE_PICKLE_IPC defaults on) is yielded as the stream's first chunk, not
                # raised, so the 200 goes out; the route turns it into an error event and stops
                # reading the batch (serving_completions.py:362-372, serving_chat.py:2568-2579),
                # then its usage chunk (the abort's one-token prompt) and [DONE]. The batch's
                # other prompts run beside it: their chunks may come first on a real server;
                # here the abort, finished at intake, is first.
                resp = await start_sse(request)
                err = {
                    "object": "error",
                    "message": msg,
                    "type": "BAD_REQUEST",
                    "param": None,
                    "code": 400,
                }
                await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
                if include_usage:
                    await resp.write(usage_chunk(1 if k % n == 0 else 0, 0))
                await resp.write(DONE)
                await resp.write_eof()
                return resp
            if not body.get("stream"):
                results = await run_nonstream(request, items, hit)
                for res in results:
                    if res.error_status:
                        return _error_openai(res.error_status, res.error_message)
                choices = []
                for i, res in enumerate(results):
                    text = res.text
                    lps = None
                    ec = echoes[i]
                    if ask is not None:
                        prev = items[i].prompt[-1] if items[i].prompt else 0
                        lps = logprobs(ask, res.shown_ids, prev, ec.offset)
                    if ec is not NO_ECHO:
                        text, lps = echoed(ec, text, lps)
                    lps = sglang_offsets(lps)
                    choice: dict[str, Any]
                    if chat:
                        choice = {
                            "index": i,
                            "message": {"role": "assistant", "content": text, "reasoning_content": None},
                            "logprobs": lps,
                            "finish_reason": finish_str(res),
                            "matched_stop": res.matched,
                        }
                        # SGLang: chat answers carry the ids as prompt_token_ids/response_token_ids
                        if want_prompt_ids:
                            choice["prompt_token_ids"] = list(items[i].prompt)
                        if want_ids:
                            choice["response_token_ids"] = list(res.output_ids)
                    else:
                        choice = {
                            "index": i,
                            "text": text,
                            "logprobs": lps,
                            "finish_reason": finish_str(res),
                            "matched_stop": res.matched,
                        }
                        if want_ids:  # completions: token_ids (output) and prompt_token_ids
                            choice["token_ids"] = list(res.output_ids)
                            choice["prompt_token_ids"] = list(items[i].prompt)
                    choices.append(choice)
                pt = sum(r.prompt_tokens for r in results[::n])
                ct = sum(len(r.output_ids) for r in results)
                return json_response(
                    {
                        "id": oid,
                        "object": obj_name,
                        "created": created,
                        "model": req_model,
                        "choices": choices,
                        "usage": openai_usage(pt, ct),
                        "metadata": {
                            "weight_version": "default",
                            "weight_versions": [{"version": "default", "start": 0, "end": ct}],
                        },
                    }
                )
            # SGLang's should_include_usage (entrypoints/openai/utils.py:250-264): per-chunk usage
            # whenever continuous_usage_stats is set, include_usage or not (vLLM needs both)
            continuous = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
            resp = await start_sse(request)

            def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
                c: dict[str, Any] = {
                    "id": oid,
                    "object": chunk_name,
                    "created": created,
                    "model": req_model,
                    "choices": [choice],
                }
                if not chat or usage is not None:  # chat chunks omit a null usage (omit_defaults)
                    c["usage"] = usage
                return sse(c)

            def so_far(it: Item, completion: int) -> dict[str, Any] | None:
                """A content chunk's usage with continuous_usage_stats (the counts so far)."""
                return openai_usage(len(it.prompt), completion) if continuous else None

            async def run(idx: int, it: Item) -> Result:
                sent = [0]
                first_sent = [False]
                ec = [echoes[idx]]  # until the first chunk of this choice has carried it
                if chat:
                    await resp.write(
                        chunk(
                            {
                                "index": idx,
                                "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                                "matched_stop": None,
                            }
                        )
                    )

                async def on_token(out: list[int]) -> None:
                    start = sent[0]
                    new = out[start:]
                    sent[0] = len(out)
                    text = "".join(tokenizer.token_text(t) for t in new)
                    lp = None
                    if ask is not None:
                        prev = out[start - 1] if start else (it.prompt[-1] if it.prompt else 0)
                        lp = logprobs(ask, list(new), prev, echoes[idx].offset + start)
                    if ec[0] is not NO_ECHO:
                        text, lp = echoed(ec[0], text, lp)
                        ec[0] = NO_ECHO
                    lp = sglang_offsets(lp)
                    if chat:
                        await resp.write(
                            chunk(
                                {
                                    "index": idx,
                                    "delta": {"reasoning_content": None, "content": text},
                                    "logprobs": lp,
                                    "finish_reason": None,
                                    "matched_stop": None,
                                },
                                so_far(it, len(out)),
                            )
                        )
                    else:
                        c: dict[str, Any] = {
                            "index": idx,
                            "text": text,
                            "logprobs": lp,
                            "finish_reason": None,
                            "matched_stop": None,
                        }
                        if want_ids:  # each chunk its new ids; the first also the prompt's
                            c["token_ids"] = list(new)
                            if not first_sent[0]:
                                c["prompt_token_ids"] = list(it.prompt)
                                first_sent[0] = True
                        await resp.write(chunk(c, so_far(it, len(out))))

                res = await api.execute(it, hit, on_token)
                if res.error_status:
                    err = {
                        "error": {
                            "message": res.error_message,
                            "type": "BadRequestError" if res.error_status == 400 else "InternalServerError",
                            "param": None,
                            "code": res.error_status,
                        }
                    }
                    await resp.write(sse_error(err))
                    return res
                if chat:
                    await resp.write(
                        chunk(
                            {
                                "index": idx,
                                "delta": {"reasoning_content": None},
                                "logprobs": None,
                                "finish_reason": finish_str(res),
                                "matched_stop": res.matched,
                            }
                        )
                    )
                else:
                    text, lp = echoed(ec[0], "", None)  # no earlier chunk: this one echoes
                    lp = sglang_offsets(lp)
                    last_choice: dict[str, Any] = {
                        "index": idx,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": finish_str(res),
                        "matched_stop": res.matched,
                    }
                    if want_ids:
                        last_choice["token_ids"] = []
                    await resp.write(chunk(last_choice, so_far(it, len(res.output_ids))))
                return res

            results = await asyncio.gather(*(run(i, it) for i, it in enumerate(items)))
            if include_usage:
                pt = sum(r.prompt_tokens for r in results[::n])
                ct = sum(len(r.output_ids) for r in results)
                await resp.write(usage_chunk(pt, ct))
            await resp.write(DONE)
            await resp.write_eof()
            return resp

        return await guarded(request, _error_openai, body_fn)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await openai(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await openai(request, chat=True)

    # ------------------------------------------------------------------ info / control
    def model_info() -> dict[str, Any]:
        return {
            "model_path": model_path,
            "served_model_name": model_path,
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null" if s.role == "both" else s.role,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }

    def server_info() -> dict[str, Any]:
        spec = s.spec
        info: dict[str, Any] = {
            "model_path": model_path,
            "tokenizer_path": model_path,
            "served_model_name": model_path,
            "context_length": api.context_length,
            "max_total_tokens": s.max_total_tokens,
            "chunked_prefill_size": s.profile.chunk_tokens
            if s.role != "prefill"
            else s.profile.max_prefill_tokens,
            "max_prefill_tokens": s.profile.max_prefill_tokens,
            "max_running_requests": s.profile.max_running,
            "schedule_policy": "fcfs",
            "page_size": s.block_size,
            "disable_radix_cache": False,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "host": spec.host,
            "port": s.port,
            "random_seed": spec.seed,
            "enable_metrics": True,
            "disaggregation_mode": "null" if s.role == "both" else s.role,
            "disaggregation_transfer_backend": "mooncake",
            "disaggregation_bootstrap_port": s.bootstrap_port if s.bootstrap_port is not None else 8998,
            "disaggregation_decode_allocation_policy": "early",
            "kv_events_config": None
            if not spec.kv_events
            else msgspec.json.encode({"publisher": "zmq", "endpoint": spec.kv_events, "topic": ""}).decode(),
            "max_req_input_len": api.max_req_input_len,
            "max_total_num_tokens": s.max_total_tokens,
            "version": "0.5.23",
            "emulator": {"profile": s.profile.name, "time_scale": spec.time_scale, "kv_port": s.kv_port},
            "internal_states": [
                {
                    "context_length": api.context_length,
                    "max_req_input_len": api.max_req_input_len,
                    "max_total_num_tokens": s.max_total_tokens,
                    "page_size": s.block_size,
                    "disaggregation_mode": "null" if s.role == "both" else s.role,
                    "effective_max_running_requests_per_dp": s.profile.max_running,
                    "last_gen_throughput": 0.0,
                    "memory_usage": {"token_capacity": s.max_total_tokens},
                }
            ],
        }
        return info

    async def h_model_info(request: web.Request) -> web.Response:
        return json_response(model_info())

    async def h_server_info(request: web.Request) -> web.Response:
        return json_response(server_info())

    async def h_models(request: web.Request) -> web.Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_path,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "sglang",
                        "root": model_path,
                        "parent": None,
                        "max_model_len": api.context_length,
                    }
                ],
            }
        )

    async def h_health(request: web.Request) -> web.Response:
        if s.dead:
            return web.Response(status=503)
        return web.Response(status=200)

    async def h_health_generate(request: web.Request) -> web.Response:
        if s.dead:
            return web.Response(status=503)
        if s.faults.has("health_ok_but_hung") or s.faults.has("hang_before_first_byte"):
            if "health_ok_but_hung" in s.faults.draw():
                await hang_forever()
        it = Item(
            f"HEALTH_CHECK_{uuid.uuid4().hex}", tokenizer.encode("h"), 1, None, 0, FAKE_BOOTSTRAP_HOST, None
        )
        res = await api.execute(it, {}, None)
        return web.Response(status=200 if not res.error_status else 503)

    async def h_metrics(request: web.Request) -> web.Response:
        return web.Response(
            text=render_sglang(s, api.max_req_input_len), content_type="text/plain", charset="utf-8"
        )

    async def h_abort(request: web.Request) -> web.Response:
        body = await read_json(request)
        if body.get("abort_all"):
            for seq in list(api.seqs.values()):
                engine.abort_seq(seq)
        else:
            api.abort(str(body.get("rid") or ""))  # by prefix, as the scheduler does
        return web.Response(status=200)

    async def h_flush(request: web.Request) -> web.Response:
        if engine.seqs:
            return web.Response(
                status=400, text="Cache not flushed. Please check if there are running requests."
            )
        engine.pool.flush()
        return web.Response(
            status=200,
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )

    async def h_loads(request: web.Request) -> web.Response:
        # SGLang 0.5.23's GET /v1/loads (its old /get_load is gone: 404). Sections: core
        # scalars always, then memory/disaggregation/queues unless `include` narrows them.
        include = request.query.get("include")
        sections = {x.strip() for x in include.split(",")} if include else {"all"}
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if not sections <= valid:
            return json_response(
                {"detail": f"Invalid include sections: {sections - valid}. Valid options: {sorted(valid)}"},
                status=400,
            )
        pool = engine.pool
        running = len(engine.seqs)
        used = pool.used_blocks * s.block_size
        inflight = len(s.kv_server.rooms) if s.kv_server else 0
        in_transfer = engine.counters.in_transfer if s.role == "decode" else 0
        load: dict[str, object] = {
            "timestamp": time.time(),
            "dp_rank": 0,
            "num_running_reqs": running,
            "num_waiting_reqs": engine.waiting + in_transfer,
            "num_waiting_uncached_tokens": 0,
            "num_used_tokens": used,
            "num_total_tokens": used,
            "num_active_tokens": used,
            "num_prealloc_ready_tokens": 0,
            "max_total_num_tokens": s.max_total_tokens,
            "max_running_requests": s.profile.max_running,
            "token_usage": pool.usage(),
            "gen_throughput": 0.0,
            "cache_hit_rate": pool.hits / pool.queries if pool.queries else 0.0,
            "utilization": min(1.0, running / max(1, s.profile.max_running)),
            "total_prefill_uncached_tokens": engine.counters.prompt_tokens_total,
            "total_prefill_busy_us": 0,
            "decode_moments": None,
        }
        every = "all" in sections
        if every or "memory" in sections:
            load["memory"] = {
                "weight_gb": 0.0,
                "kv_cache_gb": 0.0,
                "graph_gb": 0.0,
                "token_capacity": s.max_total_tokens,
            }
        if s.role != "both" and (every or "disagg" in sections):
            load["disaggregation"] = {
                "mode": s.role,
                "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": inflight if s.role == "prefill" else 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": in_transfer,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
        if every or "queues" in sections:
            load["queues"] = {
                "waiting": engine.waiting,
                "grammar": 0,
                "paused": 0,
                "retracted": 0,
                "prealloc_ready": 0,
            }
        if sections == {"core"}:
            load = {k: v for k, v in load.items() if not isinstance(v, dict)}
        return json_response(
            {
                "timestamp": datetime.now(UTC).isoformat(),
                "version": "0.5.23",
                "accelerator": None,
                "num_accelerators": 1,
                "loads": [load],
            }
        )

    r.add_post("/generate", generate)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_get("/v1/models", h_models)
    r.add_get("/health", h_health)
    r.add_get("/health_generate", h_health_generate)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, h_model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, h_server_info)
    r.add_get("/metrics", h_metrics)
    r.add_post("/abort_request", h_abort)
    r.add_route("*", "/flush_cache", h_flush)
    r.add_get("/v1/loads", h_loads)
