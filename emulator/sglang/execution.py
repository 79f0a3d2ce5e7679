"""One work item's run through the emulated SGLang engine, in the server's role: colocated
(prefill then decode here), P/D prefill (compute, offer the KV in the bootstrap room, wait for
the decode to take it) or P/D decode (fetch the room's KV, then decode)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from emulator.faults import Fault
from emulator.generation import tokens
from emulator.kvtransfer import Room, TransferError
from emulator.scheduler import Aborted, EngineDead, Seq, TooLarge
from emulator.server import EmulatorServer
from emulator.sglang.items import Item, Result
from emulator.sglang.transfer import bootstrap_timeout, fetch_kv
from emulator.stops import Stopper

OnToken = Callable[[list[int]], Awaitable[None]]

# prefill-side faults that spoil the handoff (the first one drawn acts)
_PREFILL_FAULTS = (
    "transfer_fail",
    "transfer_stall",
    "abort_during_transfer",
    "wrong_request_kv",
    "bogus_kv_params",
)


def too_long(n_input: int, max_req_input_len: int) -> str:
    """The scheduler's refusal of a prompt of `max_req_input_len` tokens or more."""
    return (
        f"Input length ({n_input} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )


class Execution:
    """The run of one item: its sequence, its output so far and its result. `mode` is
    "prefill" or "decode" in P/D, else "both"."""

    def __init__(
        self,
        server: EmulatorServer,
        seqs: dict[str, Seq],
        item: Item,
        mode: str,
        hit: dict[str, Fault],
        on_token: OnToken | None,
        max_req_input_len: int,
    ) -> None:
        self.s = server
        self.engine = server.engine
        self.seqs = seqs
        self.item = item
        self.mode = mode
        self.hit = hit
        self.on_token = on_token
        self.max_req_input_len = max_req_input_len
        self.seq = Seq(item.rid, item.prompt, item.max_new, item.sample_seed)
        self.out: list[int] = []
        self.res = Result(self.out, None, 0, len(item.prompt), self.seq.t_received, 0.0)
        self.keep_blocks = False  # a silently truncated prefill's blocks outlive the request
        self.offered: Room | None = None  # prefill: this request's bootstrap room, once offered

    async def run(self) -> Result:
        self.seqs[self.item.rid] = self.seq
        try:
            if self.mode == "prefill":
                return await self._prefill()
            await self.engine.admit(self.seq, read_cache=self.item.read_cache or self.mode == "decode")
            self.res.cached_tokens = self.seq.cached_tokens
            if self.mode == "decode":
                contents = await self._fetch_kv()
                if contents is None:
                    return await self._aborted_transfer()
                self.engine.load_remote_kv(self.seq, contents)
            else:
                await self.engine.prefill(self.seq)
                self.res.cached_tokens = self.seq.cached_tokens  # matched again when scheduled
            return await self._generate()
        except TransferError as e:
            return self._transfer_failed(e)
        except Aborted:
            self.res.finish = {
                "type": "abort",
                "message": "Abort before prefill" if not self.out else "Abort request",
                "status_code": 200,
                "err_type": None,
            }
            self.engine.counters.aborted += 1
            return self.res
        except TooLarge as e:
            return self._refused(400, str(e), "BadRequestError")
        except EngineDead:
            return self._refused(500, "Engine is dead", None)
        finally:
            self._end()

    def _refused(self, status: int, message: str, err_type: str | None) -> Result:
        self.res.error_status, self.res.error_message = status, message
        self.res.finish = {"type": "abort", "message": message, "status_code": status, "err_type": err_type}
        return self.res

    def _end(self) -> None:
        s, item = self.s, self.item
        self.res.t_first = self.seq.t_first
        self.seqs.pop(item.rid, None)
        if not self.keep_blocks:
            self.engine.release(self.seq)
        if (
            self.mode == "prefill"
            and s.kv_server is not None
            and item.room is not None
            and not self.keep_blocks
        ):
            # however the request ended (done, refused by the scheduler, aborted, cancelled,
            # failed, a fault): its bootstrap room goes, as SGLang's sender clear()s it
            s.kv_server.end_prefill(item.room, self.offered)

    # ------------------------------------------------------------------ P/D prefill
    async def _prefill(self) -> Result:
        s, engine, item, seq, hit = self.s, self.engine, self.item, self.seq, self.hit
        truncated = "silent_truncation" in hit
        await engine.admit(seq, read_cache=item.read_cache)
        await engine.prefill(seq, truncate_to=1 if truncated else None)
        self.res.cached_tokens = seq.cached_tokens
        fault = next((k for k in _PREFILL_FAULTS if k in hit), None)
        if "stale_kv_params" in hit:
            fault = "wrong_request_kv"
        assert s.kv_server is not None and item.room is not None
        contents = [engine.pool.content(b) for b in seq.prompt_blocks]
        room = self.offered = s.kv_server.offer(item.room, contents, len(item.prompt), fault)
        timeout = bootstrap_timeout(s)
        if truncated:
            return self._truncated(room, timeout)
        async for tok in tokens(s, seq, 1, hit, item.stop, first_ready=True):  # its last chunk's sample
            self.out.append(tok)
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
        # the prefill's scheduler polls its transfers between forward steps
        # (process_disagg_prefill_inflight_queue after each batch): a busy prefill finishes the
        # request, and answers its HTTP request, when the step running at the transfer's end is over
        await engine.step_boundary()
        if not sent and room.failure is not None:
            # its decode aborted or gave up (SGLang's abort notification marks the room
            # Failed), or the send failed: a 500 abort, not a 200
            raise TransferError(room.failure.stage, room.failure.reason)
        self.res.finish = {"type": "length", "length": 0}
        return self.res

    def _truncated(self, room: Room, timeout: float) -> Result:
        """SGLang #30233: the prompt is aborted, yet a 1-token KV is shipped (the room outlives
        the request: it goes when taken or after the bootstrap timeout)."""
        s, engine, item = self.s, self.engine, self.item
        assert s.kv_server is not None and item.room is not None
        keep = engine.release(self.seq, keep_prompt=True)
        self.keep_blocks = True
        room.taken.add_done_callback(lambda _: engine.free_blocks(keep))
        s.kv_server.expire_room(item.room, room, timeout)
        self.res.prompt_tokens = 1
        return self._refused(400, too_long(len(item.prompt), self.max_req_input_len), "BadRequestError")

    # ------------------------------------------------------------------ P/D decode
    async def _fetch_kv(self) -> list[bytes] | None:
        """The room's KV, or None when the transfer was aborted (sglang #33507)."""
        item, engine = self.item, self.engine
        assert item.bhost is not None and item.bport is not None and item.room is not None
        try:
            contents = await engine.abortable(
                self.seq, fetch_kv(self.s, self.seq, item.bhost, item.bport, item.room, self.hit)
            )
            engine.counters.kv_transfers_ok += 1
        except TransferError as e:
            engine.counters.kv_transfers_failed += 1
            if e.kind != "aborted":
                raise
            return None
        return contents

    async def _aborted_transfer(self) -> Result:
        """sglang #33507: the client sees a normal "length" finish after one token."""
        self.engine.set_state(self.seq)
        async for tok in tokens(self.s, self.seq, 1, self.hit, self.item.stop, first_ready=True):
            self.out.append(tok)
        if self.on_token is not None:
            await self.on_token(self.out)
        self.res.finish = {"type": "length", "length": len(self.out)}
        return self.res

    def _transfer_failed(self, e: TransferError) -> Result:
        item = self.item
        what = "handshake" if e.kind == "handshake" else "transfer"
        msg = (
            f"Decode {what} failed for request rank=0 decode_req.req.rid='{item.rid}' "
            f"decode_req.req.bootstrap_room={item.room} with exception "
            f"KVTransferError(bootstrap_room={item.room}): {e}"
        )
        if self.mode == "prefill":
            # handle_bootstrap_failure (a room that never left KVPoll.Bootstrapping: timed out,
            # or its decode aborted first) or handle_inflight_transfer_failure (after the
            # decode bootstrapped), disaggregation/prefill.py:1352-1378, 1282-1310
            what = "bootstrap" if e.kind in ("bootstrap", "timeout") else "transfer"
            msg = (
                f"Prefill {what} failed for request rank=0 req.rid='{item.rid}' "
                f"req.bootstrap_room={item.room} with exception "
                f"KVTransferError(bootstrap_room={item.room}): {e}"
            )
        self.engine.counters.bootstrap_failed += what in ("handshake", "bootstrap")
        return self._refused(500, msg, None)

    # ------------------------------------------------------------------ decoding
    async def _generate(self) -> Result:
        """Decode the output. A stream gets an event per decode step, or with `--stream-interval`
        N > 1 the first token at once and then an event whenever N tokens are unsent (SGLang
        0.5.23 scheduler_components/output_streamer.py); a stop string's possible start is held
        back, and the rest comes before the finish."""
        out, on_token, res = self.out, self.on_token, self.res
        every = max(1, self.s.spec.stream_interval)
        stopper = Stopper(self.item.stop) if self.item.stop is not None else None
        shown = 0  # tokens a stream has shown (a stop string's possible start is held back)
        # the first token is out without a decode step: sampled by the prefill's last chunk, or
        # (P/D decode) the prefill's, streamed as the request joins the batch (the decode's
        # prebuilt batch: process_batch_result_prebuilt, then stream_output)
        gen = tokens(self.s, self.seq, self.item.max_new, self.hit, self.item.stop, first_ready=True)
        try:
            async for tok in gen:
                out.append(tok)
                stopped = stopper is not None and stopper.feed(tok)
                if stopped:
                    break
                if on_token is not None and (shown == 0 or len(out) - shown >= every):
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
