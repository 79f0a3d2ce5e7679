"""One worker's KV-event stream: a ZMQ SUB socket, sequence numbers, replays, epochs.

A background task per worker (`KvEventSubscriber.run`) reads the engine's PUB socket and applies
each batch to the `KvEventIndex` in sequence order. The stream's sequence numbers say what was
missed (wire format: adapters/kvevents.py):

- `seq == last + 1`: applied;
- a gap (`seq > last + 1`, the PUB socket dropped messages at its high-water mark, or the
  connection was down): the missing batches are asked from the engine's replay socket; applied
  if they come back whole, else the worker's entries are dropped and rebuilt from what the
  engine still buffers (a **resync**: the longest unbroken run of batches up to now, applied to
  an empty index, so the index holds only blocks it saw stored and never removed since);
- `seq <= last` with other content, or a replay whose batch `last` differs from the one applied
  (checked after every reconnection): a **new engine process** (a restart, a new epoch): the
  worker's entries are dropped and rebuilt the same way;
- the first message after start-up: the history before it is asked from the replay socket too.

While the connection is down, or a replay is in progress, the worker is not "live" and the
policy does not read its precise index. Without a replay socket a gap or a restart drops the
worker's entries and indexing starts again from the live stream (under-counting, never over).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from adapters.kvevents import (
    END_SEQ,
    KvEventError,
    decode_batch,
    replay_request,
    split_live,
    split_replay,
)
from gateway.kvevents.index import KvEventIndex, payload_digest
from gateway.logging import get_logger

log = get_logger("pd_gateway.kvevents")

# asks the engine for its buffered batches from a seq on: [(seq, payload), ...]; None when the
# engine did not answer
Replayer = Callable[[int], Awaitable[list[tuple[int, bytes]] | None]]


class KvEventSubscriber:
    """Reads one worker's KV events into the index (see the module docstring)."""

    def __init__(
        self,
        index: KvEventIndex,
        worker_id: str,
        engine: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        ctx: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 2.0,
        replayer: Replayer | None = None,
    ) -> None:
        """`replayer`: how replays are asked (default: the engine's ROUTER socket at
        `replay_endpoint`; none without one)."""
        self.index = index
        self.worker_id = worker_id
        self.engine = engine
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.replay_timeout_s = replay_timeout_s
        self._replayer: Replayer | None = replayer or (self._zmq_replay if replay_endpoint else None)
        self._check_epoch = False

    async def run(self) -> None:
        """Until cancelled."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self.index.set_state(self.worker_id, "connecting")
        try:
            await self.initial_sync()
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    self._connection_event(parse_monitor_message(await monitor.recv_multipart()))
                if sub in ready:
                    frames = await sub.recv_multipart()
                    try:
                        seq, payload = split_live(frames)
                    except KvEventError as e:
                        self._not_understood(e)
                        continue
                    await self.on_message(seq, payload)
        finally:
            self.index.set_state(self.worker_id, "stopped")
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    def _connection_event(self, msg: Mapping[str, object]) -> None:
        if msg.get("event") == zmq.EVENT_DISCONNECTED:
            self.index.set_state(self.worker_id, "connecting")
            self._check_epoch = True  # the engine may come back as a new process
            log.info("kv_events.disconnected", worker=self.worker_id, endpoint=self.endpoint)
        elif msg.get("event") == zmq.EVENT_CONNECTED:
            log.info("kv_events.connected", worker=self.worker_id, endpoint=self.endpoint)

    def _not_understood(self, e: Exception) -> None:
        self.index.misalign(
            self.worker_id, f"events not understood (engine {self.engine}, {self.endpoint}): {e}"
        )

    # -- sequence handling ----------------------------------------------------------------------

    async def initial_sync(self) -> None:
        """At start-up, what the engine still buffers (a fresh engine: nothing), so that the
        index is live before the first event (without a replay socket: at the first event)."""
        if self._replayer is None:
            return
        w = self.index.worker(self.worker_id)
        if w is None or w.last_seq is not None:
            return
        got = await self._replay_or_none(0)
        if got is None:
            return
        run: list[tuple[int, bytes]] = []
        for s, p in reversed(got):  # the unbroken run up to the newest
            if run and s != run[-1][0] - 1:
                break
            run.append((s, p))
        for s, p in reversed(run):
            self._apply(s, p)
        self.index.set_state(self.worker_id, "live")

    async def on_message(self, seq: int, payload: bytes) -> None:
        w = self.index.worker(self.worker_id)
        if w is None:
            return
        last = w.last_seq
        digest = payload_digest(payload)
        if w.seen(seq, digest):
            return  # the same batch again (a replay overlapped the live stream)
        check, self._check_epoch = self._check_epoch, False
        if last is None or seq != last + 1 or check:
            self.index.set_state(self.worker_id, "resyncing")  # not read while catching up
        if last is not None and seq <= last:
            log.warning("kv_events.restart", worker=self.worker_id, seq=seq, last_seq=last)
            self.index.clear(self.worker_id, "restart")
            await self._resync(seq)
        elif last is None:
            await self._resync(seq)
        elif check:
            await self._after_reconnect(seq, last)
        elif seq > last + 1:
            w.gaps += 1
            log.info("kv_events.gap", worker=self.worker_id, missing=seq - last - 1, last_seq=last)
            await self._fill(seq, last)
        self._apply(seq, payload, digest)
        self.index.set_state(self.worker_id, "live")

    def _apply(self, seq: int, payload: bytes, digest: bytes | None = None) -> bool:
        try:
            batch = decode_batch(payload, self.engine)
        except KvEventError as e:
            self._not_understood(e)
            return False
        self.index.apply(self.worker_id, seq, digest or payload_digest(payload), batch)
        return True

    async def _fill(self, seq: int, last: int) -> None:
        """Batches last+1 .. seq-1 from the replay socket, else a resync."""
        got = [(s, p) for s, p in await self._replay(last + 1) if s < seq]
        if [s for s, _ in got] == list(range(last + 1, seq)):
            for s, p in got:
                self._apply(s, p)
            return
        self.index.clear(self.worker_id, "resync")
        await self._resync(seq)

    async def _after_reconnect(self, seq: int, last: int) -> None:
        """Same engine process (its batch `last` is the one applied) or a new one?"""
        w = self.index.worker(self.worker_id)
        assert w is not None
        got = await self._replay(last)
        if got and got[0][0] == last and payload_digest(got[0][1]) == w.last_digest:
            rest = [(s, p) for s, p in got[1:] if s < seq]
            if [s for s, _ in rest] == list(range(last + 1, seq)):
                for s, p in rest:
                    self._apply(s, p)
                return
            w.gaps += 1
            self.index.clear(self.worker_id, "resync")
        elif self._replayer is None:
            self.index.clear(self.worker_id, "resync")  # cannot tell: start over
        else:
            log.warning("kv_events.restart", worker=self.worker_id, seq=seq, last_seq=last)
            self.index.clear(self.worker_id, "restart")
        await self._resync(seq)

    async def _resync(self, seq: int) -> None:
        """Rebuild from the longest unbroken run of buffered batches ending at seq - 1 (the index
        is empty: first contact, or cleared by the caller)."""
        self.index.set_state(self.worker_id, "resyncing")
        got = [(s, p) for s, p in await self._replay(0) if s < seq] if seq > 0 else []
        run: list[tuple[int, bytes]] = []
        for s, p in reversed(got):
            if s != seq - 1 - len(run):
                break
            run.append((s, p))
        for s, p in reversed(run):
            self._apply(s, p)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        """The engine's buffered batches from `start` on ([] without a replay socket, or if it
        does not answer in time), in seq order."""
        return await self._replay_or_none(start) or []

    async def _replay_or_none(self, start: int) -> list[tuple[int, bytes]] | None:
        if self._replayer is None:
            return None
        w = self.index.worker(self.worker_id)
        if w is not None:
            w.replays += 1
        got = await self._replayer(start)
        return None if got is None else sorted(got, key=lambda sp: sp[0])

    async def _zmq_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        assert self.replay_endpoint is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart(replay_request(start))
            async with asyncio.timeout(self.replay_timeout_s):
                while True:
                    s, p = split_replay(await sock.recv_multipart())
                    if s == END_SEQ:
                        break
                    out.append((s, p))
        except TimeoutError:
            log.warning(
                "kv_events.replay_timeout",
                worker=self.worker_id,
                endpoint=self.replay_endpoint,
                start=start,
                got=len(out),
            )
            return None
        except KvEventError as e:
            log.warning("kv_events.replay_malformed", worker=self.worker_id, error=str(e))
            return None
        finally:
            sock.close(0)
        return out
