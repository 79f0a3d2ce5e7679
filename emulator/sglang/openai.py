"""SGLang's OpenAI routes (``/v1/completions``, ``/v1/chat/completions``): the request model's
checks, the tokenizer manager's refusals, the scheduler's abort of a too long prompt, and the
whole answer (the stream is :mod:`emulator.sglang.openai_stream`).

Completions' ``echo`` (:mod:`emulator.echo`): the prompt's text leads each choice's text; with a
non-zero ``logprobs`` (``logprob_start_len = 0``) the prompt is computed without its cached prefix
and its logprobs lead the choice's, except on a P/D decode, which never computed the prompt: its
choice logprobs cover only the output, as on the real engine. ``max_tokens`` must be positive.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from emulator import tokenizer
from emulator.echo import NO_ECHO, Echo, echoed
from emulator.faults import Fault
from emulator.lax import coerce_openai, lax_token_ids, normalize_openai_prompt
from emulator.logprobs import LogprobAsk, logprob_ask, logprobs, sglang_offsets
from emulator.sampling_checks import sglang_openai_refusal
from emulator.sglang.errors import error_openai, max_tokens_error
from emulator.sglang.items import Item, Result, make_items, num_samples, sampling_seed
from emulator.sglang.openai_stream import Shape, Streamed, openai_usage
from emulator.sglang.runner import SglangRunner
from emulator.stops import stop_spec
from emulator.wire import end_sse, json_response, start_sse


class OpenAICall:
    """One completions or chat request; `held` collects the rids it holds."""

    def __init__(
        self,
        runner: SglangRunner,
        request: web.Request,
        body: dict[str, Any],
        hit: dict[str, Fault],
        held: list[str],
        chat: bool,
    ) -> None:
        self.runner = runner
        self.request = request
        self.body = body
        self.hit = hit
        self.held = held
        self.chat = chat
        self.stream = False
        self.want_ids = False
        self.want_prompt_ids = False
        self.ask: LogprobAsk | None = None

    async def answer(self) -> web.StreamResponse:
        body, chat = self.body, self.chat
        # pydantic's request model: a refused field is a 400 while parsing, before any work
        refused = coerce_openai(body, chat)
        if (why := normalize_openai_prompt(body, chat) or refused) is not None:
            return error_openai(400, why, "Bad Request")
        self.stream = bool(body.get("stream"))  # (as coerced)
        self.want_ids = bool(body.get("return_token_ids"))
        self.want_prompt_ids = self.want_ids or bool(chat and body.get("return_prompt_token_ids"))
        parsed = self._items()
        if isinstance(parsed, web.Response):
            return parsed
        items, n = parsed
        dup = self.runner.rids.hold(
            items, self.held
        )  # stream or not, a 400: the first chunk is awaited first
        if dup is not None:
            return error_openai(400, dup)
        echo_on = not chat and bool(body.get("echo"))
        scored = echo_on and bool(body.get("logprobs"))  # SGLang: logprob_start_len = 0
        for it in items:
            it.read_cache = not scored
        echoes = [self.runner.echo(it, self.ask, scored) if echo_on else NO_ECHO for it in items]
        # stream or not, a 400 before any event (the stream's first chunk is awaited first)
        bad = self.runner.refusal(items, [sglang_openai_refusal(body, chat)] * (len(items) // n), n)
        if bad is not None:
            return error_openai(400, bad)
        self.runner.crash_on_bad_ids(items, self.request)
        shape = Shape(uuid.uuid4().hex, int(time.time()), body.get("model") or self.runner.s.model_name, chat)
        if sched := self.runner.scheduler_refusals(items, self.hit):
            k, (_, msg) = next(iter(sched.items()))
            return await self._scheduler_abort(shape, msg, 1 if k % n == 0 else 0)
        if not self.stream:
            return self._whole(shape, items, echoes, await self.runner.run_whole(items, self.hit), n)
        resp = await start_sse(self.request)
        return await Streamed(self.runner, resp, shape, self.hit, self.ask, self.want_ids, body).run(
            items, echoes, n
        )

    def _prompts(self) -> tuple[list[list[int]], Any] | web.Response:
        """The prompts and the output budget as asked (or a 400 for completions' `max_tokens`)."""
        body = self.body
        if self.chat and body.get("input_ids") is not None:
            # SGLang 0.5.23's chat takes `input_ids` as the prompt itself, the template skipped
            # (openai/protocol.py ChatCompletionRequest.input_ids, a pydantic list[int];
            # serving_chat.py:1947 and :1343)
            ids = lax_token_ids(body["input_ids"])
            if ids is None:
                return error_openai(
                    400,
                    "1 validation error: input_ids: Input should be a valid list of integers",
                    "Bad Request",
                )
            return [ids], body.get("max_completion_tokens") or body.get("max_tokens")
        if self.chat:
            # SGLang's budget is ``max_completion_tokens or max_tokens`` (protocol.py:1214,
            # serving_chat.py:1180): a 0 or null max_completion_tokens falls through
            return [tokenizer.encode_chat(body.get("messages") or [])], (
                body.get("max_completion_tokens") or body.get("max_tokens")
            )
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
            return max_tokens_error(mt)
        return prompts, mt

    def _items(self) -> tuple[list[Item], int] | web.Response:
        """The request's items (prompt-major, `n` samples each) and `n`, or a 400."""
        body, chat = self.body, self.chat
        got = self._prompts()
        if isinstance(got, web.Response):
            return got
        prompts, mt = got
        max_new = int(mt) if mt is not None else max(1, self.runner.s.max_model_len - len(prompts[0]))
        try:
            n = num_samples(body.get("n"))
            self.ask = logprob_ask(body, chat)
            stop = stop_spec(body, "no_stop_trim", "min_tokens")
        except (TypeError, ValueError) as e:
            return error_openai(400, str(e))
        if chat and self.stream and self.want_prompt_ids:
            field = "return_token_ids" if self.want_ids else "return_prompt_token_ids"
            where = " on /v1/chat/completions" if self.want_ids else ""
            return error_openai(
                400,
                f"{field} is not supported with streaming{where}. "
                f"Please set stream=false when using {field}=true.",
            )
        batch = len(prompts) > 1 or n > 1
        return make_items(body, prompts, max_new, sampling_seed(body), n, stop, batch), n

    async def _scheduler_abort(self, shape: Shape, msg: str, prompt_tokens: int) -> web.StreamResponse:
        """The scheduler's abort of a too long prompt. Whole: a 400. Streamed: the abort (its
        status_code an HTTPStatus: the IPC pickles it, SGLANG_USE_PICKLE_IPC defaults on) is
        yielded as the stream's first chunk, not raised, so the 200 goes out; the route turns it
        into an error event and stops reading the batch (serving_completions.py:362-372,
        serving_chat.py:2568-2579), then its usage chunk (the abort's one-token prompt) and
        [DONE]. The batch's other prompts run beside it: their chunks may come first on a real
        server; here the abort, finished at intake, is first."""
        if not self.stream:
            return error_openai(400, msg)
        resp = await start_sse(self.request)
        err = {"object": "error", "message": msg, "type": "BAD_REQUEST", "param": None, "code": 400}
        await resp.write(b"data: " + json.dumps({"error": err}).encode() + b"\n\n")
        if bool((self.body.get("stream_options") or {}).get("include_usage")):
            await resp.write(shape.usage_chunk(prompt_tokens, 0))
        return await end_sse(resp)

    def _whole(
        self, shape: Shape, items: list[Item], echoes: list[Echo], results: list[Result], n: int
    ) -> web.Response:
        for res in results:
            if res.error_status:
                return error_openai(res.error_status, res.error_message)
        choices = [self._choice(i, items[i], echoes[i], res) for i, res in enumerate(results)]
        pt = sum(r.prompt_tokens for r in results[::n])
        ct = sum(len(r.output_ids) for r in results)
        cached = (
            sum(r.cached_tokens for r in results[::n]) if self.runner.s.spec.enable_cache_report else None
        )
        return json_response(
            {
                "id": shape.oid,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": shape.created,
                "model": shape.model,
                "choices": choices,
                "usage": openai_usage(pt, ct, cached),
                "metadata": {
                    "weight_version": "default",
                    "weight_versions": [{"version": "default", "start": 0, "end": ct}],
                },
            }
        )

    def _choice(self, i: int, item: Item, ec: Echo, res: Result) -> dict[str, Any]:
        text = res.text
        lps = None
        if self.ask is not None:
            prev = item.prompt[-1] if item.prompt else 0
            lps = logprobs(self.ask, res.shown_ids, prev, ec.offset)
        if ec is not NO_ECHO:
            text, lps = echoed(ec, text, lps)
        lps = sglang_offsets(lps)
        choice: dict[str, Any]
        if self.chat:
            choice = {
                "index": i,
                "message": {"role": "assistant", "content": text, "reasoning_content": None},
                "logprobs": lps,
                "finish_reason": res.finish_type,
                "matched_stop": res.matched,
            }
            # SGLang: chat answers carry the ids as prompt_token_ids/response_token_ids
            if self.want_prompt_ids:
                choice["prompt_token_ids"] = list(item.prompt)
            if self.want_ids:
                choice["response_token_ids"] = list(res.output_ids)
            return choice
        choice = {
            "index": i,
            "text": text,
            "logprobs": lps,
            "finish_reason": res.finish_type,
            "matched_stop": res.matched,
        }
        if self.want_ids:  # completions: token_ids (output) and prompt_token_ids
            choice["token_ids"] = list(res.output_ids)
            choice["prompt_token_ids"] = list(item.prompt)
        return choice
