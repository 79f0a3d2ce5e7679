"""The emulated SGLang engine behind the HTTP routes: the tokenizer manager's and scheduler's
checks, the request ids, and running work items (:class:`emulator.sglang.execution.Execution`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from emulator import tokenizer
from emulator.echo import Echo, echo
from emulator.faults import Fault
from emulator.logprobs import LogprobAsk
from emulator.server import EmulatorServer
from emulator.sglang.execution import Execution, OnToken, too_long
from emulator.sglang.items import FAKE_BOOTSTRAP_HOST, Item, Result
from emulator.sglang.rids import RidTable
from emulator.wire import crash


class SglangRunner:
    def __init__(self, server: EmulatorServer) -> None:
        self.s = server
        self.engine = server.engine
        self.context_length = server.max_model_len
        self.max_req_input_len = min(self.context_length - 1, server.max_total_tokens - 1) - 5
        self.rids = RidTable(server.engine)

    # ------------------------------------------------------------------ checks
    def validate(self, n_input: int, max_new: int) -> str | None:
        """The tokenizer manager's length checks (``_validate_one_request``)."""
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
            return too_long(n_input, self.max_req_input_len)
        return None

    def scheduler_refusals(self, items: list[Item], hit: dict[str, Fault]) -> dict[int, tuple[Item, str]]:
        """The scheduler's ``validate_input_length`` (``handle_generate_request``, before it
        queues the request; managers/utils.py), request by request: each item of
        ``max_req_input_len`` tokens or more, by its index, finishes with a 400 abort, whatever
        the disaggregation mode, so a colocated server refuses it as a prefill does. Not
        modelled on a decode; a prefill with the ``silent_truncation`` fault ships a 1-token KV
        instead (``Execution``)."""
        if self.s.role == "decode" or (self.s.role == "prefill" and "silent_truncation" in hit):
            return {}
        return {
            k: (it, msg)
            for k, it in enumerate(items)
            if (msg := self.scheduler_reject(len(it.prompt))) is not None
        }

    def refusal(self, items: list[Item], refused: list[str | None], n: int) -> str | None:
        """The tokenizer manager's refusal of a request: request after request, its length
        checks (``_validate_one_request``, tokenizer_manager.py:1271, 1307-1379), then its
        sampling params' ``verify`` (:1567; `refused`, one per prompt: item ``k`` is prompt
        ``k // n``'s). Both are ValueErrors raised inside ``generate_request``'s generator."""
        for k, it in enumerate(items):
            msg = self.validate(len(it.prompt), it.max_new)
            if msg is not None:
                return msg
            if (msg := refused[k // n]) is not None:
                return msg
        return None

    def crash_on_bad_ids(self, items: list[Item], request: web.Request) -> None:
        for it in items:
            if it.prompt and (min(it.prompt) < 0 or max(it.prompt) >= tokenizer.VOCAB_SIZE):
                # SGLang 0.5.23 does not check prompt ids: the scheduler's embedding lookup raises,
                # the scheduler exits and takes the server with it (seen on the real engine); the
                # request gets no answer
                self.s.fatal()
                crash(request)
            stop = it.stop
            if stop is not None and stop.min_tokens > 0 and stop.ids:
                if min(stop.ids) < 0 or max(stop.ids) >= tokenizer.VOCAB_SIZE:
                    # nor its stop_token_ids: with a minimum length, the min-new-tokens penalizer
                    # scatters them into a vocabulary-wide tensor (penaltylib/min_new_tokens.py,
                    # `scatter_add_` over `vocab_size + 1` columns), which raises in the scheduler
                    self.s.fatal()
                    crash(request)

    # ------------------------------------------------------------------ running
    def mode(self, item: Item) -> str:
        """How this server serves `item`: "prefill" or "decode" in P/D, else "both"."""
        s = self.s
        pd = item.room is not None and item.bhost != FAKE_BOOTSTRAP_HOST and s.role != "both"
        return s.role if pd else "both"

    def echo(self, item: Item, ask: LogprobAsk | None, scored: bool) -> Echo:
        """A completion's echo of `item`'s prompt; its logprobs only where the prompt was computed
        (a P/D decode has no input logprobs)."""
        return echo(item.prompt, ask, show_text=True, scored=scored and self.mode(item) != "decode")

    async def execute(self, item: Item, hit: dict[str, Fault], on_token: OnToken | None) -> Result:
        """Run `item`; `on_token` (a stream) gets the output shown so far, event by event."""
        run = Execution(self.s, self.rids.seqs, item, self.mode(item), hit, on_token, self.max_req_input_len)
        return await run.run()

    async def run_whole(self, items: list[Item], hit: dict[str, Fault]) -> list[Result]:
        """Run the items side by side for a whole (not streamed) answer."""
        tasks = [asyncio.ensure_future(self.execute(it, hit, None)) for it in items]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
