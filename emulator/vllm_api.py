"""vLLM 0.32/0.33's OpenAI-compatible surface with the NixlConnector P/D handoff.

Batches of prompts and ``n > 1`` are served locally (:func:`run_multi` inside :func:`setup`), never
handed off: choice ``k = prompt_index * n + sample_index``, sample ``j`` seeded ``seed + j``.

Completions' ``echo`` and the prompt logprobs (``echo`` with ``logprobs``, ``prompt_logprobs``)
are shaped by :mod:`emulator.echo`. A request computing prompt logprobs reads no cached prefix
(vLLM's ``skip_reading_prefix_cache``): on a P/D decode it ignores the prefill's KV, computes the
whole prompt itself and only notifies the prefill, which frees the blocks it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
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
from emulator.echo import (
    NO_ECHO,
    Echo,
    echo,
    echoed,
    vllm_chat_echo,
    vllm_prompt_logprobs,
    vllm_prompt_logprobs_k,
)
from emulator.faults import Fault
from emulator.flows import MidStreamFault, tokens, vllm_pull_kv, vllm_skip_remote_kv
from emulator.kvtransfer import Held, TransferError
from emulator.lax import (
    VLLM_NO_NULL_CHAT,
    VLLM_NO_NULL_COMPLETIONS,
    coerce_openai,
    normalize_openai_prompt,
    vllm_seed_error,
)
from emulator.logprobs import LogprobAsk, logprob_ask, logprobs
from emulator.metrics import render_vllm
from emulator.sampling_checks import vllm_refusal
from emulator.scheduler import Aborted, EngineDead, Seq, TooLarge
from emulator.stops import Stopper, StopSpec, stop_spec

ENGINE_DEAD_MSG = "EngineCore encountered an issue. See stack trace (above) for the root cause."
LEASE_S = 30.0


class HandoffError(Exception):
    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def _release(
    out: list[int],
    shown: int,
    last: bool,
    stopper: Stopper | None,
    ask: LogprobAsk | None,
    prompt: list[int],
    ec: Echo = NO_ECHO,
    first: bool = False,
) -> tuple[int, list[int], str, dict[str, Any] | None]:
    """What a stream shows after its newest token: (tokens shown from now on, the new ones,
    their text, their logprobs). A possible stop string's start stays held back. A choice's
    first chunk carries its echo (`first`; echo without generation: the echo alone)."""
    now = stopper.shown(len(out), last) if stopper is not None else len(out)
    new = out[shown:now]
    text = "".join(tokenizer.token_text(t) for t in new)
    lp = None
    if ask is not None and new:
        before = out[shown - 1] if shown else (prompt[-1] if prompt else 0)
        lp = logprobs(ask, new, before, ec.offset + shown)
    if first and ec is not NO_ECHO:
        return (now, new, *echoed(ec, text, lp))
    return now, new, text, lp


def _token_choice(
    index: int,
    chat: bool,
    text: str,
    lp: dict[str, Any] | None,
    new: list[int],
    last: bool,
    stopper: Stopper | None,
    shown: int,
    prompt: list[int],
    return_ids: bool,
) -> dict[str, Any]:
    """A stream chunk's choice for the tokens `new` (chat: a delta; the finish comes in a chunk
    of its own. Completions: the last one carries the finish)."""
    if chat:
        return {
            "index": index,
            "delta": {"content": text},
            "logprobs": lp,
            "finish_reason": None,
            "token_ids": new if return_ids else None,
        }
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": lp,
        "finish_reason": _finish(stopper) if last else None,
        "stop_reason": _stop_reason(stopper) if last else None,
    }
    if return_ids:
        choice["prompt_token_ids"] = prompt if shown == 0 else None
        choice["token_ids"] = new
    return choice


def _finish(stopper: Stopper | None) -> str:
    return "stop" if stopper is not None and stopper.matched is not None else "length"


def _stop_reason(stopper: Stopper | None) -> str | int | None:
    """vLLM names what stopped a sequence: the stop string or the stop token id."""
    return None if stopper is None else stopper.matched


def _error(status: int, message: str, typ: str | None = None, param: str | None = None) -> web.Response:
    typ = typ or (
        "BadRequestError" if status == 400 else "InternalServerError" if status >= 500 else "NotFoundError"
    )
    return json_response({"error": {"message": message, "type": typ, "param": param, "code": status}}, status)


async def _failed(resp: web.StreamResponse | None, message: str) -> web.StreamResponse:
    """The engine failed the request: a 500, or a started stream's error event and [DONE]."""
    if resp is None:
        return _error(500, message)
    await resp.write(sse_error(_error_dict(500, message)))
    await resp.write(DONE)
    await resp.write_eof()
    return resp


def _error_dict(status: int, message: str) -> dict[str, Any]:
    typ = "BadRequestError" if status == 400 else "InternalServerError"
    return {"error": {"message": message, "type": typ, "param": None, "code": status}}


def setup(s: EmulatorServer) -> None:
    engine = s.engine
    r = s.app.router
    served = s.model_name
    max_len = s.max_model_len
    seqs: dict[str, Seq] = {}
    last_params: list[dict[str, Any]] = []

    def running_usage(pt: int, ct: int, chat: bool) -> dict[str, Any]:
        """A chunk's usage with `stream_options.continuous_usage_stats` (and `include_usage`:
        vLLM's should_include_usage, entrypoints/serve/utils/api_utils.py:289-301), the counts so
        far, as `UsageInfo(...).model_dump_json(exclude_unset=True)` writes them (chat also sets
        completion_tokens_details, to null)."""
        u: dict[str, Any] = {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}
        if chat:
            u["completion_tokens_details"] = None
        return u

    def chat_echo_chunk(
        oid: str, created: int, model_name: str, index: int, text: str, n_prompt: int, continuous: bool
    ) -> bytes:
        """A chat stream's echo (``vllm_chat_echo``): a chunk of its own per choice after the role
        chunks, no finish or logprobs (chat_completion/serving.py:591-624)."""
        return sse(
            {
                "id": oid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [
                    {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
                ],
            }
            | ({"usage": running_usage(n_prompt, 0, True)} if continuous else {})
        )

    def terminal_stamp(include_usage: bool) -> dict[str, Any]:
        """A stream's terminal chunks (those with a finish_reason) carry the system fingerprint
        when no usage chunk follows to carry it (completion/serving.py:425-432,
        chat_completion/serving.py:803-811)."""
        return {} if include_usage else {"system_fingerprint": s.fingerprint}

    def continuous_usage(body: dict[str, Any]) -> bool:
        opts = body.get("stream_options") or {}
        return bool(opts.get("include_usage")) and bool(opts.get("continuous_usage_stats"))

    def usage(pt: int, ct: int, cached: int, stream: bool) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}
        u["prompt_tokens_details"] = {"cached_tokens": cached}
        if not stream:
            u["completion_tokens_details"] = None
        return u

    def sample_seed(body: dict[str, Any]) -> int | None:
        t = body.get("temperature")
        if t is None or float(t) <= 0.0:
            return None
        seed = body.get("seed")
        return int(seed) if seed is not None else secrets.randbits(31)

    def make_params(seq: Seq, request_id: str, blocks: list[int]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": s.engine_id,
            "remote_request_id": request_id,
            "remote_host": s.advertised_host,
            "remote_port": s.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(seq.prompt),
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": seq.cached_tokens,
        }

    async def handle(request: web.Request, chat: bool) -> web.StreamResponse:
        with track(s):
            if s.dead:
                return _error(500, ENGINE_DEAD_MSG)
            try:
                raw = await request.read()
                body = msgspec.json.decode(raw) if raw else {}
                if not isinstance(body, dict):
                    raise ValueError("body must be a JSON object")
            except (msgspec.DecodeError, ValueError) as e:
                return _error(400, f"Invalid request: {e}")
            # pydantic's request model: a refused field is a 400 while parsing, before any work
            refused = coerce_openai(body, chat, VLLM_NO_NULL_CHAT if chat else VLLM_NO_NULL_COMPLETIONS)
            if (why := normalize_openai_prompt(body, chat) or refused) is not None:
                return _error(400, why)
            if (why := vllm_seed_error(body)) is not None:
                return _error(400, why, param="seed")
            if not isinstance(body.get("kv_transfer_params", {}), dict | None):
                # the request model's `kv_transfer_params: dict[str, Any] | None`
                return _error(
                    400, "1 validation error: kv_transfer_params: Input should be a valid dictionary"
                )
            hit = s.faults.draw()
            early = await s.apply_entry_faults(hit, lambda st, msg: _error(st, msg))
            if early is not None:
                engine.counters.errors += 1
                return early
            try:
                resp = await run(request, body, chat, hit)
            except MidStreamFault as e:
                if e.kind == "crash_mid_stream":
                    crash(request)
                await hang_forever()
                raise
            except asyncio.CancelledError:
                engine.counters.aborted += 1
                raise
            if resp.status >= 400:
                engine.counters.errors += 1
            else:
                engine.counters.completed += 1
            return resp

    notices: set[asyncio.Task[None]] = set()

    def reject_remote_prefill(body: dict[str, Any]) -> None:
        """A decode refusing a request before admission still frees the prefill's blocks held
        for it: vLLM 0.32 submits it pre-aborted (``_with_kv_transfer_rejection_cleanup``,
        entrypoints/generate/base/serving.py; NIXL ``request_finished`` then notifies the
        prefill). Sent in the background: the refusal does not wait for it."""
        ktp = body.get("kv_transfer_params")
        if not isinstance(ktp, dict) or not ktp.get("do_remote_prefill") or s.role != "decode":
            return  # (a colocated server has no KV connector to tell: has_kv_connector)

        async def notify() -> None:
            with contextlib.suppress(Exception):  # vLLM only logs a failed notification
                await vllm_skip_remote_kv(s, ktp)

        task = asyncio.ensure_future(notify())
        notices.add(task)
        task.add_done_callback(notices.discard)

    def echo_of(prompt: list[int], body: dict[str, Any], chat: bool, ask: LogprobAsk | None) -> Echo:
        """A completion's echo: the prompt's text (none when it answers token ids) and, with
        `logprobs`, the prompt's logprobs; `max_tokens` 0 echoes without generation."""
        if chat or not body.get("echo"):
            return NO_ECHO
        only = body.get("max_tokens") == 0
        return echo(prompt, ask, show_text=not body.get("return_token_ids"), scored=True, only=only)

    def out_limit(body: dict[str, Any], chat: bool) -> tuple[str, int | None]:
        """The request's output-token limit as vLLM reads it, with its field's name: chat's
        ``max_completion_tokens`` when set, else ``max_tokens`` (chat_completion/protocol.py:
        658-663, chat_completion/serving.py:343-347); completions have ``max_tokens`` only, 16
        when absent (completion/protocol.py:63)."""
        if chat:
            mct = body.get("max_completion_tokens")
            if mct is not None:
                return "max_completion_tokens", int(mct)
            mt = body.get("max_tokens")
        else:
            mt = body.get("max_tokens", 16)
        return "max_tokens", None if mt is None else int(mt)

    def max_new_for(prompt: list[int], body: dict[str, Any], chat: bool) -> int:
        """``get_max_tokens`` (entrypoints/serve/utils/api_utils.py:169-205): the request's
        limit clamped to the room its prompt leaves, the whole room when it sets none. Not
        refused here: a result below 1 is ``SamplingParams``' refusal (``vllm_refusal``)."""
        mt = out_limit(body, chat)[1]
        room = max_len - len(prompt)
        return room if mt is None else min(mt, room)

    def check_output_limit(body: dict[str, Any], chat: bool) -> web.Response | None:
        """``TokenizeParams.__post_init__`` (renderers/params.py:256-268), run when the renderer
        builds its params (``build_tok_params``), before any prompt is tokenized."""
        param, mt = out_limit(body, chat)
        mt = mt or 0  # build_tok_params: ``max_output_tokens=... or 0``
        if mt > max_len:
            return _error(
                400,
                f"{param}={mt} cannot be greater than max_model_len={max_len}. Please request fewer "
                f"output tokens. (parameter={param}, value={mt})",
                param=param,
            )
        return None

    def check_length(prompt: list[int], text: bool) -> web.Response | None:
        if not prompt and not text:
            # v1/engine/input_processor.py _validate_model_input: a ValueError, a 400
            return _error(400, "The decoder prompt cannot be empty")
        if prompt and (min(prompt) < 0 or max(prompt) >= tokenizer.VOCAB_SIZE):
            # vLLM's renderer validates prompt token ids (VLLMValidationError -> 400)
            bad = min(prompt) if min(prompt) < 0 else max(prompt)
            return _error(400, f"Token id {bad} is out of vocabulary")
        n_prompt = len(prompt)
        if n_prompt > max_len:
            # TokenizeParams._token_len_check (renderers/params.py:515-535). A text prompt (chat's
            # too: its template renders text) is tokenized with max_length = max_model_len + 1
            # (get_encode_kwargs, :351-376), so it counts at most that many; the qualifier
            # follows the count alone.
            count = min(n_prompt, max_len + 1) if text else n_prompt
            qualifier = "at least " if count == max_len + 1 else ""
            return _error(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={count})",
                param="input_tokens",
            )
        return None

    def engine_refusal(prompts: list[list[int]]) -> str | None:
        """The engine's own prompt check (v1/engine/input_processor.py:557-601): a prompt that
        fills the context leaves no room for the one token ``SamplingParams`` asks at least.
        Reached only by an echo without generation (its ``max_tokens`` is 1 whatever the room,
        completion/protocol.py:377,395): any other such prompt got ``max_tokens`` 0 and was
        refused by ``SamplingParams``."""
        for pr in prompts:
            if len(pr) == max_len:
                return (
                    f"The decoder prompt (length {max_len}) plus the number of requested output tokens "
                    f"(at least 1) is longer than the maximum model length of {max_len}. Make sure that "
                    "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                    "output tokens)."
                )
        return None

    async def run(
        request: web.Request, body: dict[str, Any], chat: bool, hit: dict[str, Fault]
    ) -> web.StreamResponse:
        if body.get("stream_options") and not body.get("stream"):
            # the request model's validate_stream_options (entrypoints/openai/completion/protocol.py,
            # chat_completion/protocol.py): refused while parsing, so no KV cleanup either
            return _error(
                400,
                "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
                param="stream_options",
            )
        texts = [True]  # per prompt: text (tokenized here), not token ids
        if chat:
            prompts = [tokenizer.encode_chat(body.get("messages") or [])]
        else:
            p = body.get("prompt", "")
            if isinstance(p, list) and p and isinstance(p[0], int):
                prompts, texts = [[int(x) for x in p]], [False]
            elif isinstance(p, list) and p:
                prompts = [
                    [int(t) for t in x] if isinstance(x, list) else tokenizer.encode(str(x)) for x in p
                ]
                texts = [not isinstance(x, list) for x in p]
            elif isinstance(p, list):
                prompts = [tokenizer.encode("")]
            else:
                prompts = [tokenizer.encode(str(p))]
        try:
            n_samples = 1 if body.get("n") is None else int(body["n"])
        except (TypeError, ValueError):
            return _error(400, "n must be an integer", param="n")
        try:
            ask = logprob_ask(body, chat, s.spec.max_logprobs)
            stop = stop_spec(body, "include_stop_str_in_output", "min_tokens", strings_wait=True)
        except ValueError as e:
            return _error(400, str(e))
        try:
            plp_k = vllm_prompt_logprobs_k(body, chat, ask)
        except ValueError as e:
            return _error(400, str(e), param="prompt_logprobs")
        # echo without generation: vLLM generates one token and drops it
        echo_only = not chat and bool(body.get("echo")) and body.get("max_tokens") == 0
        limits = {**body, "max_tokens": 1} if echo_only else body
        if n_samples < 1:
            return _error(400, f"n must be at least 1, got {n_samples}.", param="n")
        # the renderer's checks (its params, then each prompt), then SamplingParams' (per
        # prompt): _verify_args, then _verify_greedy_sampling; then the engine's prompt check.
        # Each one raised inside create_*: the KV connector is told (reject_remote_prefill).
        bad = check_output_limit(body, chat)
        for pr, is_text in zip(prompts, texts, strict=True):
            if bad is None:
                bad = check_length(pr, is_text)
        if bad is not None:
            reject_remote_prefill(body)
            return bad
        # SamplingParams.max_tokens: get_max_tokens' value, 1 for an echo without generation
        # (completion/protocol.py:395)
        refused = vllm_refusal(body, [1 if echo_only else max_new_for(pr, body, chat) for pr in prompts])
        if refused is not None:
            reject_remote_prefill(body)
            return _error(400, refused[0], param=refused[1])
        temperature = body.get("temperature")
        if n_samples > 1 and isinstance(temperature, int | float) and temperature < 1e-5:
            # vLLM 0.32 SamplingParams._verify_greedy_sampling (seen on the real engine)
            return _error(400, f"n must be 1 when using greedy sampling, got {n_samples}.")
        if (why := engine_refusal(prompts)) is not None:
            # raised by the engine's generate() when the response's generator first reads it: a
            # 400 (the app's exception handler), or when streaming a 200 with one error event
            # (completion/serving.py:497-503)
            if not body.get("stream"):
                reject_remote_prefill(body)
                return _error(400, why)
            failed = await start_sse(request)
            await failed.write(sse_error(_error_dict(400, why)))
            await failed.write(DONE)
            await failed.write_eof()
            return failed
        if len(prompts) > 1 or n_samples > 1:
            return await run_multi(request, body, chat, hit, prompts, n_samples, ask, stop, plp_k, limits)
        prompt = prompts[0]
        n_prompt = len(prompt)
        max_new = max_new_for(prompt, limits, chat)
        ec = echo_of(prompt, body, chat, ask)
        chat_echo = vllm_chat_echo(body) if chat else ""
        scoring = plp_k is not None  # prompt logprobs: no cached prefix, no remote KV is read
        xrid = request.headers.get("X-Request-Id")
        base = xrid if xrid else secrets.token_hex(8)
        oid = ("chatcmpl-" if chat else "cmpl-") + base
        engine_rid = f"{oid}-{secrets.token_hex(4)}" if chat else f"{oid}-0-{secrets.token_hex(4)}"
        ktp = body.get("kv_transfer_params") or {}
        # Only the P/D roles run the NixlConnector. A colocated server (`both`) runs none, and
        # vLLM without a KV connector reads no kv_transfer_params: its scheduler consults no
        # connector (Scheduler._connector_finished answers (False, None) when self.connector is
        # None), so the request is served whole and its answer's kv_transfer_params is null
        remote_decode = bool(ktp.get("do_remote_decode")) and s.role == "prefill"
        remote_prefill = bool(ktp.get("do_remote_prefill")) and s.role == "decode"
        stream = bool(body.get("stream")) and not remote_decode
        seq = Seq(engine_rid, prompt, 1 if remote_decode else max_new, sample_seed(body))
        seqs[engine_rid] = seq
        created = int(time.time())
        return_ids = bool(body.get("return_token_ids"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        continuous = continuous_usage(body)
        stamp = terminal_stamp(include_usage)
        out: list[int] = []
        params_out: dict[str, Any] | None = None
        held = False
        reached_prefill = False  # decode: the prefill's blocks were read or it was notified
        resp: web.StreamResponse | None = None
        try:
            await engine.admit(seq, read_cache=not scoring)
            if remote_prefill and scoring:
                reached_prefill = True
                await vllm_skip_remote_kv(s, ktp)
                await engine.prefill(seq)
            elif remote_prefill:
                groups = ktp.get("remote_block_ids")
                ids = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], list) else []
                if len(ids) < seq.n_prompt_blocks:
                    # vLLM: assert num_decode_blocks <= len(prefill_group) kills the EngineCore
                    raise HandoffError(ENGINE_DEAD_MSG, fatal=True)
                if stream:
                    resp = await start_sse(request)
                reached_prefill = True
                try:
                    contents = await engine.abortable(seq, vllm_pull_kv(s, seq, ktp, hit))
                    engine.counters.kv_transfers_ok += 1
                except TransferError as e:
                    engine.counters.kv_transfers_failed += 1
                    if e.kind == "aborted":
                        contents = []
                    else:
                        raise HandoffError("Internal server error") from e
                engine.load_remote_kv(seq, contents)
                if "abort_during_transfer" in hit or (not contents):
                    seq.max_new = 1
                    max_new = 1
            else:
                await engine.prefill(
                    seq, truncate_to=1 if (remote_decode and "silent_truncation" in hit) else None
                )
            n = 1 if remote_decode else max_new
            if stream and resp is None:
                resp = await start_sse(request)
            first = True
            shown = 0  # tokens whose text a stream has shown (a stop string's start is held back)
            stopper = Stopper(stop) if stop is not None else None
            steps = tokens(s, seq, n, hit, stop)
            try:
                async for tok in steps:
                    if first and remote_prefill and "tie_flip" in hit and prompt:
                        # the decode's own pass over the prompt's last token (vLLM recomputes
                        # it to sample) lands on the other side of a near tie
                        if model.tie_gap(prompt[-1], tok) is not None:
                            tok = model.runner_up(tok)
                    out.append(tok)
                    stopped = stopper is not None and stopper.feed(tok)
                    last = stopped or len(out) == n
                    if resp is not None:
                        now, new, text, lp = _release(out, shown, last, stopper, ask, prompt, ec, first)
                        if chat and first:
                            await resp.write(
                                sse(
                                    {
                                        "id": oid,
                                        "object": "chat.completion.chunk",
                                        "created": created,
                                        "model": body.get("model") or served,
                                        "choices": [
                                            {
                                                "index": 0,
                                                "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None,
                                                "finish_reason": None,
                                            }
                                        ],
                                        "prompt_token_ids": prompt if return_ids else None,
                                        "prompt_text": None,
                                    }
                                    | ({"usage": running_usage(n_prompt, 0, chat)} if continuous else {})
                                )
                            )
                            if chat_echo:
                                await resp.write(
                                    chat_echo_chunk(
                                        oid,
                                        created,
                                        body.get("model") or served,
                                        0,
                                        chat_echo,
                                        n_prompt,
                                        continuous,
                                    )
                                )
                        if new or (last and not chat) or (first and ec is not NO_ECHO):
                            choice = _token_choice(
                                0, chat, text, lp, new, last, stopper, shown, prompt, return_ids
                            )
                            await resp.write(
                                sse(
                                    {
                                        "id": oid,
                                        "object": "chat.completion.chunk" if chat else "text_completion",
                                        "created": created,
                                        "model": body.get("model") or served,
                                        "choices": [choice],
                                    }
                                    | (stamp if last and not chat else {})
                                    | (
                                        {"usage": running_usage(n_prompt, len(out), chat)}
                                        if continuous
                                        else {}
                                    )
                                )
                            )
                            shown = now
                    first = False
                    if stopped:
                        break
            finally:
                await steps.aclose()
            # Some of vLLM's KV connectors (Mooncake's) hand over a prefill's KV only when the
            # engine core ended it capped by length (FINISHED_LENGTH_CAPPED in request_finished).
            # With its one token a stop id, 0.32 still caps it by length first (and a stop string
            # is the front end's finding, after that); newer vLLM judges the stop id first: the
            # prefill frees its blocks and answers `kv_transfer_params: null`
            stopped_first = (
                s.spec.stop_checks_first and stopper is not None and isinstance(stopper.matched, int)
            )
            if remote_decode and not stopped_first:
                truncated = "silent_truncation" in hit
                seq.kv_valid = seq.kv_valid and not truncated
                blocks = engine.release(seq, keep_prompt=True)
                held = True
                assert s.kv_server is not None
                fault = next(
                    (
                        k
                        for k in (
                            "transfer_fail",
                            "transfer_stall",
                            "abort_during_transfer",
                            "wrong_request_kv",
                        )
                        if k in hit
                    ),
                    None,
                )

                def expired() -> None:
                    engine.counters.kv_expired += 1

                s.kv_server.hold(engine_rid, Held(blocks, n_prompt, fault), LEASE_S, expired)
                params_out = make_params(seq, engine_rid, blocks)
                if "stale_kv_params" in hit and last_params:
                    params_out = dict(last_params[-1])
                bogus = hit.get("bogus_kv_params")
                if bogus is not None:
                    mode = bogus.get_str("mode", "range")
                    params_out = dict(params_out)
                    if mode == "empty":
                        params_out["remote_block_ids"] = [[]]
                    elif mode == "short":
                        params_out["remote_block_ids"] = [blocks[:1]]
                    elif mode == "engine":
                        params_out["remote_engine_id"] = "00000000-0000-0000-0000-000000000000"
                    else:
                        params_out["remote_block_ids"] = [
                            [engine.pool.num_blocks + 9999 + i for i in range(len(blocks))]
                        ]
                last_params.append(make_params(seq, engine_rid, blocks))
                del last_params[:-4]
        except HandoffError as e:
            if e.fatal:
                s.fatal()
            return await _failed(resp, str(e))
        except TooLarge as e:
            return _error(400, str(e))
        except EngineDead:
            return await _failed(resp, ENGINE_DEAD_MSG)
        except MidStreamFault as e:
            if e.kind != "error_mid_stream":
                raise
            return await _failed(resp, ENGINE_DEAD_MSG)  # as EngineDead, for this request alone
        except Aborted:
            engine.counters.aborted += 1
        finally:
            seqs.pop(engine_rid, None)
            if not held:
                engine.release(seq)
            if remote_prefill and not reached_prefill and not s.dead:
                # ended before its KV was read (aborted, cancelled, refused by the engine): vLLM's
                # connector still notifies the prefill, which frees the blocks it holds for it
                reject_remote_prefill(body)
        ct = len(out)
        cached = seq.cached_tokens
        model_name = body.get("model") or served
        if resp is not None:
            if chat:
                await resp.write(
                    sse(
                        {
                            "id": oid,
                            "object": "chat.completion.chunk",
                            "created": created,
                            "model": model_name,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": {"content": ""},
                                    "logprobs": None,
                                    "finish_reason": _finish(stopper),
                                    "stop_reason": _stop_reason(stopper),
                                    "token_ids": None,
                                }
                            ],
                        }
                        | stamp
                        | ({"usage": running_usage(n_prompt, ct, True)} if continuous else {})
                    )
                )
            if include_usage:
                await resp.write(
                    sse(
                        {
                            "id": oid,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": usage(n_prompt, ct, cached, True),
                            "system_fingerprint": s.fingerprint,
                        }
                    )
                )
            await resp.write(DONE)
            await resp.write_eof()
            return resp
        shown_ids = out[: stopper.shown(len(out), True)] if stopper is not None else out
        text = tokenizer.decode(shown_ids)
        lps = logprobs(ask, shown_ids, prompt[-1] if prompt else 0, ec.offset) if ask is not None else None
        if ec is not NO_ECHO:
            text, lps = echoed(ec, text, lps)
        text = chat_echo + text
        prompt_lps = vllm_prompt_logprobs(prompt, plp_k) if plp_k is not None else None
        if chat:
            obj: dict[str, Any] = {
                "id": oid,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning": None,
                        },
                        "logprobs": lps,
                        "finish_reason": _finish(stopper),
                        "stop_reason": _stop_reason(stopper),
                        "token_ids": out if return_ids else None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": s.fingerprint,
                "usage": usage(n_prompt, ct, cached, False),
                "prompt_logprobs": prompt_lps,
                "prompt_token_ids": prompt if return_ids else None,
                "prompt_text": None,
                "kv_transfer_params": params_out,
                "ec_transfer_params": None,
                "metrics": None,
            }
        else:
            obj = {
                "id": oid,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": lps,
                        "finish_reason": _finish(stopper),
                        "stop_reason": _stop_reason(stopper),
                        "token_ids": out if return_ids else None,
                        "prompt_logprobs": prompt_lps,
                        "prompt_token_ids": prompt if return_ids else None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": s.fingerprint,
                "usage": usage(n_prompt, ct, cached, False),
                "kv_transfer_params": params_out,
                "ec_transfer_params": None,
                "metrics": None,
            }
        return json_response(obj)

    async def run_multi(
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        hit: dict[str, Fault],
        prompts: list[list[int]],
        n: int,
        ask: LogprobAsk | None,
        stop: StopSpec | None,
        plp_k: int | None,
        limits: dict[str, Any],
    ) -> web.StreamResponse:
        """A batch of prompts and/or ``n > 1`` samples, served locally (the gateway sends these to
        one worker without ``kv_transfer_params``). Choice ``k = prompt_index * n + sample_index``;
        sample ``j`` is a child request seeded ``seed + j`` (vLLM's ``ParentRequest``). `limits`
        is the body as its lengths count (echo without generation: one token)."""
        xrid = request.headers.get("X-Request-Id")
        oid = ("chatcmpl-" if chat else "cmpl-") + (xrid if xrid else secrets.token_hex(8))
        model_name = body.get("model") or served
        created = int(time.time())
        obj_name = "chat.completion.chunk" if chat else "text_completion"
        return_ids = bool(body.get("return_token_ids"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        continuous = continuous_usage(body)
        stamp = terminal_stamp(include_usage)
        stream = bool(body.get("stream"))
        base_seed = sample_seed(body)
        children: list[tuple[int, Seq]] = []
        for i, prompt in enumerate(prompts):
            max_new = max_new_for(prompt, limits, chat)
            try:
                engine.check_fits(len(prompt), max_new)
            except TooLarge as e:
                return _error(400, str(e))
            parent = f"{oid}-{secrets.token_hex(4)}" if chat else f"{oid}-{i}-{secrets.token_hex(4)}"
            for j in range(n):
                rid = parent if n == 1 else f"{j}_{parent}"
                children.append((max_new, Seq(rid, prompt, max_new, model.sample_seed(base_seed, j))))
        outs: list[list[int]] = [[] for _ in children]
        echoes = [echo_of(seq.prompt, body, chat, ask) for _, seq in children]
        chat_echo = vllm_chat_echo(body) if chat else ""
        finish: list[str] = ["length"] * len(children)
        stoppers = [Stopper(stop) if stop is not None else None for _ in children]
        resp: web.StreamResponse | None = None

        def chunk(choice: dict[str, Any], **extra: Any) -> bytes:
            c = {"id": oid, "object": obj_name, "created": created, "model": model_name, "choices": [choice]}
            return sse(c | extra)

        if stream:
            resp = await start_sse(request)
            if chat:
                for k in range(len(children)):
                    await resp.write(
                        chunk(
                            {
                                "index": k,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            },
                            prompt_token_ids=prompts[0] if return_ids else None,
                            prompt_text=None,
                            **({"usage": running_usage(len(prompts[0]), 0, True)} if continuous else {}),
                        )
                    )
                for k in range(len(children) if chat_echo else 0):  # after all the role chunks
                    await resp.write(
                        chat_echo_chunk(oid, created, model_name, k, chat_echo, len(prompts[0]), continuous)
                    )

        async def child(k: int, max_new: int, seq: Seq) -> None:
            seqs[seq.rid] = seq
            out = outs[k]
            ec = echoes[k]
            try:
                await engine.admit(seq, read_cache=plp_k is None)
                await engine.prefill(seq)
                stopper = stoppers[k]
                shown = 0
                steps = tokens(s, seq, max_new, hit, stop)
                try:
                    async for tok in steps:
                        out.append(tok)
                        stopped = stopper is not None and stopper.feed(tok)
                        if stopped:
                            finish[k] = "stop"
                        last = stopped or len(out) == max_new
                        if resp is not None:
                            first = len(out) == 1
                            now, new, text, lp = _release(
                                out, shown, last, stopper, ask, seq.prompt, ec, first
                            )
                            if new or (last and not chat) or (first and ec is not NO_ECHO):
                                choice = _token_choice(
                                    k, chat, text, lp, new, last, stopper, shown, seq.prompt, return_ids
                                )
                                extra = (stamp if last and not chat else {}) | (
                                    {"usage": running_usage(len(seq.prompt), len(out), chat)}
                                    if continuous
                                    else {}
                                )
                                await resp.write(chunk(choice, **extra))
                                shown = now
                        if stopped:
                            break
                finally:
                    await steps.aclose()
            except Aborted:
                engine.counters.aborted += 1
                finish[k] = "abort"
            finally:
                seqs.pop(seq.rid, None)
                engine.release(seq)
            if resp is not None and chat:
                await resp.write(
                    chunk(
                        {
                            "index": k,
                            "delta": {"content": ""},
                            "logprobs": None,
                            "finish_reason": finish[k],
                            "stop_reason": _stop_reason(stoppers[k]),
                            "token_ids": None,
                        },
                        **stamp,
                        **({"usage": running_usage(len(seq.prompt), len(out), True)} if continuous else {}),
                    )
                )

        tasks = [asyncio.ensure_future(child(k, mn, seq)) for k, (mn, seq) in enumerate(children)]
        try:
            await asyncio.gather(*tasks)
        except EngineDead:
            return await _failed(resp, ENGINE_DEAD_MSG)
        except MidStreamFault as e:
            if e.kind != "error_mid_stream":
                raise
            return await _failed(resp, ENGINE_DEAD_MSG)  # as EngineDead, for this request alone
        finally:
            for t in tasks:
                t.cancel()
        pt = sum(len(p) for p in prompts)
        ct = sum(len(o) for o in outs)
        cached = sum(seq.cached_tokens for _, seq in children[::n])
        if resp is not None:
            if include_usage:
                await resp.write(
                    sse(
                        {
                            "id": oid,
                            "object": obj_name,
                            "created": created,
                            "model": model_name,
                            "choices": [],
                            "usage": usage(pt, ct, cached, True),
                            "system_fingerprint": s.fingerprint,
                        }
                    )
                )
            await resp.write(DONE)
            await resp.write_eof()
            return resp
        choices: list[dict[str, Any]] = []
        for k, (_, seq) in enumerate(children):
            stopper = stoppers[k]
            out = outs[k]
            shown_ids = out[: stopper.shown(len(out), True)] if stopper is not None else out
            ec = echoes[k]
            prev = seq.prompt[-1] if seq.prompt else 0
            lps = logprobs(ask, shown_ids, prev, ec.offset) if ask is not None else None
            text, lps = echoed(ec, tokenizer.decode(shown_ids), lps)
            text = chat_echo + text
            prompt_lps = vllm_prompt_logprobs(seq.prompt, plp_k) if plp_k is not None else None
            if chat:
                choices.append(
                    {
                        "index": k,
                        "message": {
                            "role": "assistant",
                            "content": text,
                            "refusal": None,
                            "annotations": None,
                            "audio": None,
                            "function_call": None,
                            "tool_calls": [],
                            "reasoning": None,
                        },
                        "logprobs": lps,
                        "finish_reason": finish[k],
                        "stop_reason": _stop_reason(stopper),
                        "token_ids": out if return_ids else None,
                        "routed_experts": None,
                    }
                )
            else:
                choices.append(
                    {
                        "index": k,
                        "text": text,
                        "logprobs": lps,
                        "finish_reason": finish[k],
                        "stop_reason": _stop_reason(stopper),
                        "token_ids": out if return_ids else None,
                        "prompt_logprobs": prompt_lps,
                        "prompt_token_ids": seq.prompt if return_ids else None,
                        "routed_experts": None,
                    }
                )
        obj: dict[str, Any] = {
            "id": oid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": s.fingerprint,
            "usage": usage(pt, ct, cached, False),
        }
        if chat:
            obj["prompt_logprobs"] = vllm_prompt_logprobs(prompts[0], plp_k) if plp_k is not None else None
            obj["prompt_token_ids"] = prompts[0] if return_ids else None
            obj["prompt_text"] = None
        obj |= {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}
        return json_response(obj)

    async def completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=False)

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await handle(request, chat=True)

    async def models(request: web.Request) -> web.Response:
        now = int(time.time())
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": served,
                        "object": "model",
                        "created": now,
                        "owned_by": "vllm",
                        "root": served,
                        "parent": None,
                        "max_model_len": max_len,
                        "permission": [
                            {
                                "id": f"modelperm-{secrets.token_hex(8)}",
                                "object": "model_permission",
                                "created": now,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if s.dead else 200)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=render_vllm(s), content_type="text/plain", charset="utf-8")

    async def tokenize(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        if "messages" in body:
            ids = tokenizer.encode_chat(body["messages"])
        else:
            ids = tokenizer.encode(
                str(body.get("prompt", "")), add_bos=bool(body.get("add_special_tokens", True))
            )
        return json_response({"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": None})

    async def detokenize(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        return json_response({"prompt": tokenizer.decode(body.get("tokens", []))})

    async def abort(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read() or b"{}")
        rid = str(body.get("request_id", body.get("rid", "")))
        for key, seq in list(seqs.items()):
            key = re.sub(r"^\d+_", "", key)  # a child of an n > 1 request: "{index}_{parent}"
            if key == rid or key.startswith(rid + "-"):
                engine.abort_seq(seq)
        return web.Response(status=200)

    r.add_post("/v1/completions", completions)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_get("/v1/models", models)
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_post("/tokenize", tokenize)
    r.add_post("/detokenize", detokenize)
    r.add_post("/emulator/abort", abort)
