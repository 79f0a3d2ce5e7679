"""The OpenAI routes' chunk shapes on SGLang and their streamed answers: per choice a role chunk
(chat), a chunk per event of new tokens, a finish chunk; then the usage chunk and ``[DONE]``."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from emulator import tokenizer
from emulator.echo import NO_ECHO, Echo, echoed
from emulator.faults import Fault
from emulator.logprobs import LogprobAsk, logprobs, sglang_offsets
from emulator.sglang.items import Item, Result
from emulator.sglang.runner import SglangRunner
from emulator.wire import end_sse, sse, sse_error


def cache_details(cached: int | None) -> dict[str, int] | None:
    """`prompt_tokens_details` with `--enable-cache-report` (`cached`: the prompts' cached
    tokens; None without the flag): SGLang fills it only when the count is above 0
    (entrypoints/openai/usage_processor.py `_details_if_cached`)."""
    return {"cached_tokens": cached} if cached else None


def openai_usage(prompt_tokens: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": cache_details(cached),
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


class Shape:
    """What every chunk of one answer shares: its id, creation time, model and object name."""

    def __init__(self, oid: str, created: int, model: str, chat: bool) -> None:
        self.oid = oid
        self.created = created
        self.model = model
        self.chat = chat
        self.chunk_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None = None) -> bytes:
        c: dict[str, Any] = {
            "id": self.oid,
            "object": self.chunk_name,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if not self.chat or usage is not None:  # chat chunks omit a null usage (omit_defaults)
            c["usage"] = usage
        return sse(c)

    def usage_chunk(self, pt: int, ct: int, cached: int | None = None) -> bytes:
        usage: dict[str, Any]
        if self.chat:
            usage = openai_usage(pt, ct, cached)
        else:  # (the completions route leaves out the fields that are None)
            usage = {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}
            details = cache_details(cached)
            if details is not None:
                usage["prompt_tokens_details"] = details
            usage["reasoning_tokens"] = 0
        last: dict[str, Any] = {
            "id": self.oid,
            "object": self.chunk_name,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
        return sse(last)


class Streamed:
    """A streamed answer of the OpenAI routes: its choices run side by side."""

    def __init__(
        self,
        runner: SglangRunner,
        resp: web.StreamResponse,
        shape: Shape,
        hit: dict[str, Fault],
        ask: LogprobAsk | None,
        want_ids: bool,
        body: dict[str, Any],
    ) -> None:
        self.runner = runner
        self.resp = resp
        self.shape = shape
        self.hit = hit
        self.ask = ask
        self.want_ids = want_ids
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        # SGLang's should_include_usage (entrypoints/openai/utils.py:250-264): per-chunk usage
        # whenever continuous_usage_stats is set, include_usage or not (vLLM needs both)
        self.continuous = bool(opts.get("continuous_usage_stats"))

    async def run(self, items: list[Item], echoes: list[Echo], n: int) -> web.StreamResponse:
        choices = [_ChoiceStream(self, idx, it, echoes[idx]) for idx, it in enumerate(items)]
        results = await asyncio.gather(*(c.run() for c in choices))
        if self.include_usage:
            pt = sum(r.prompt_tokens for r in results[::n])
            ct = sum(len(r.output_ids) for r in results)
            cached = (
                sum(r.cached_tokens for r in results[::n]) if self.runner.s.spec.enable_cache_report else None
            )
            await self.resp.write(self.shape.usage_chunk(pt, ct, cached))
        return await end_sse(self.resp)

    def so_far(self, it: Item, completion: int) -> dict[str, Any] | None:
        """A content chunk's usage with continuous_usage_stats (the counts so far)."""
        return openai_usage(len(it.prompt), completion) if self.continuous else None


class _ChoiceStream:
    """One choice's chunks: `sent` tokens shown so far; the echo rides its first chunk."""

    def __init__(self, stream: Streamed, idx: int, item: Item, ec: Echo) -> None:
        self.stream = stream
        self.idx = idx
        self.item = item
        self.echo = ec  # the whole echo (its offset counts the output's logprob offsets)
        self.pending_echo = ec  # until the first chunk of this choice has carried it
        self.sent = 0
        self.first_sent = False

    async def run(self) -> Result:
        st, shape = self.stream, self.stream.shape
        if shape.chat:
            await st.resp.write(
                shape.chunk(
                    {
                        "index": self.idx,
                        "delta": {"reasoning_content": None, "role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                        "matched_stop": None,
                    }
                )
            )
        res = await st.runner.execute(self.item, st.hit, self.on_token)
        if res.error_status:
            err = {
                "error": {
                    "message": res.error_message,
                    "type": "BadRequestError" if res.error_status == 400 else "InternalServerError",
                    "param": None,
                    "code": res.error_status,
                }
            }
            await st.resp.write(sse_error(err))
            return res
        await st.resp.write(self._finish_chunk(res))
        return res

    def _finish_chunk(self, res: Result) -> bytes:
        st, shape = self.stream, self.stream.shape
        if shape.chat:
            return shape.chunk(
                {
                    "index": self.idx,
                    "delta": {"reasoning_content": None},
                    "logprobs": None,
                    "finish_reason": res.finish_type,
                    "matched_stop": res.matched,
                }
            )
        text, lp = echoed(self.pending_echo, "", None)  # no earlier chunk: this one echoes
        last_choice: dict[str, Any] = {
            "index": self.idx,
            "text": text,
            "logprobs": sglang_offsets(lp),
            "finish_reason": res.finish_type,
            "matched_stop": res.matched,
        }
        if st.want_ids:
            last_choice["token_ids"] = []
        return shape.chunk(last_choice, st.so_far(self.item, len(res.output_ids)))

    async def on_token(self, out: list[int]) -> None:
        st, it = self.stream, self.item
        start = self.sent
        new = out[start:]
        self.sent = len(out)
        text = "".join(tokenizer.token_text(t) for t in new)
        lp = None
        if st.ask is not None:
            prev = out[start - 1] if start else (it.prompt[-1] if it.prompt else 0)
            lp = logprobs(st.ask, list(new), prev, self.echo.offset + start)
        if self.pending_echo is not NO_ECHO:
            text, lp = echoed(self.pending_echo, text, lp)
            self.pending_echo = NO_ECHO
        lp = sglang_offsets(lp)
        if st.shape.chat:
            choice = {
                "index": self.idx,
                "delta": {"reasoning_content": None, "content": text},
                "logprobs": lp,
                "finish_reason": None,
                "matched_stop": None,
            }
            await st.resp.write(st.shape.chunk(choice, st.so_far(it, len(out))))
            return
        c: dict[str, Any] = {
            "index": self.idx,
            "text": text,
            "logprobs": lp,
            "finish_reason": None,
            "matched_stop": None,
        }
        if st.want_ids:  # each chunk its new ids; the first also the prompt's
            c["token_ids"] = list(new)
            if not self.first_sent:
                c["prompt_token_ids"] = list(it.prompt)
                self.first_sent = True
        await st.resp.write(st.shape.chunk(c, st.so_far(it, len(out))))
