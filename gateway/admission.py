"""Admission control: how many client requests run at once, and what waits or is shed.

A request takes a *slot* before the orchestrator sees it and gives it back when its response is
finished (streams included). With a slot free and nobody queued, `admit_now` is an int compare
and an increment: no lock, no future, no timer. Otherwise the request waits in a bounded FIFO
queue (one future per waiter, handed its slot directly by the request that leaves) for at most
`queue_timeout_s`.

Shed, in OpenAI's error shape with `Retry-After`:
- 503 `overloaded`: the queue is full (`max_queue`; 0 = no queue, shed as soon as all slots are busy);
- 503 `queue_timeout`: no slot within `queue_timeout_s`;
- 503 `shutting_down`: the gateway is stopping (queued requests are released with it too);
- 429 `too_many_concurrent_requests`: one client already has `per_client_max_concurrent`
  requests running or queued (0 = off). A client is its socket's address, or the value of a
  configured header (`limits.client_key_header`, read by the handlers).

Optionally `max_inflight_tokens` bounds the sum of the requests' token estimates (prompt +
max_tokens); a request larger than the whole budget still runs, alone.

Counters are plain ints read at scrape time (`stats()`), never prometheus calls on the hot path.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec

from common.errors import ErrorCode, GatewayError, Overloaded, Unavailable
from gateway.config import LimitsConfig

SHED_REASONS = ("queue_full", "queue_timeout", "per_client", "shutting_down")


class AdmissionStats(msgspec.Struct, frozen=True):
    active: int
    active_tokens: int
    queued: int
    clients: int  # clients with a request running or queued (per-client cap on only)
    admitted: int  # admitted at once
    admitted_after_queue: int  # admitted after waiting in the queue
    queue_wait_s: float  # total time admitted requests spent queued
    shed: dict[str, int]
    max_concurrent: int
    max_queue: int
    max_inflight_tokens: int | None
    closed: bool


class Admission:
    def __init__(
        self,
        max_concurrent: int,
        max_queue: int,
        queue_timeout_s: float,
        *,
        per_client_max_concurrent: int = 0,
        max_inflight_tokens: int | None = None,
        retry_after_s: float = LimitsConfig().retry_after_s,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.per_client = per_client_max_concurrent
        self.max_tokens = max_inflight_tokens
        self.retry_after_s = retry_after_s
        self.active = 0
        self.active_tokens = 0
        self.queued = 0  # live waiters (the deque may also hold finished futures, skipped lazily)
        self._waiters: deque[tuple[asyncio.Future[bool], int]] = deque()
        self._clients: dict[str, int] = {}
        self.closed = False
        self.admitted = 0
        self.admitted_after_queue = 0
        self.queue_wait_s = 0.0
        self.shed = dict.fromkeys(SHED_REASONS, 0)

    # -- the request path ------------------------------------------------------------------------

    def admit_now(self, client: str, tokens: int = 0) -> bool:
        """Take a slot if one is free and nobody is queued (True); False: call `wait`.
        Raises the 429 (per-client cap) or the 503 (shutting down) error."""
        if self.closed:
            self.shed["shutting_down"] += 1
            raise Unavailable(
                "the gateway is shutting down",
                code=ErrorCode.SHUTTING_DOWN,
                retry_after_s=self.retry_after_s,
            )
        if self.per_client:
            n = self._clients.get(client, 0)
            if n >= self.per_client:
                self.shed["per_client"] += 1
                raise Overloaded(
                    f"too many concurrent requests from this client (limit {self.per_client})",
                    code=ErrorCode.CLIENT_CONCURRENCY,
                    retry_after_s=self.retry_after_s,
                )
            self._clients[client] = n + 1
        limit = self.max_tokens  # (`_fits`, inline)
        if (
            self.active < self.max_concurrent
            and not self.queued
            and (limit is None or self.active == 0 or self.active_tokens + tokens <= limit)
        ):
            self.active += 1
            self.active_tokens += tokens
            self.admitted += 1
            return True
        return False

    async def wait(self, client: str, tokens: int = 0) -> None:
        """Queue for a slot (after `admit_now` said False). Returns owning a slot, or raises the
        503; on cancellation nothing is held."""
        if self.queued >= self.max_queue:
            self._forget_client(client)
            self.shed["queue_full"] += 1
            raise Unavailable(
                f"the gateway is at capacity ({self.max_concurrent} requests running, "
                f"{self.queued} queued); try again later",
                retry_after_s=self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiters.append((fut, tokens))
        self.queued += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                granted = await fut
        except BaseException as e:
            if fut.done() and not fut.cancelled() and fut.result():
                # woken in the same loop iteration as the timeout / cancellation: the slot is ours
                if isinstance(e, TimeoutError):
                    granted = True
                else:
                    self.leave(client, tokens)
                    raise
            else:
                if not fut.done():
                    fut.cancel()
                    self.queued -= 1
                elif fut.cancelled():
                    self.queued -= 1
                # (a False result: close() already took it off the queue)
                self._forget_client(client)
                self._after_abandon()
                if isinstance(e, TimeoutError):
                    self.shed["queue_timeout"] += 1
                    raise Unavailable(
                        f"no capacity became free within {self.queue_timeout_s:g}s; try again later",
                        code=ErrorCode.QUEUE_TIMEOUT,
                        retry_after_s=self.retry_after_s,
                    ) from None
                raise
        if not granted:  # released by close()
            self._forget_client(client)
            self.shed["shutting_down"] += 1
            raise Unavailable(
                "the gateway is shutting down",
                code=ErrorCode.SHUTTING_DOWN,
                retry_after_s=self.retry_after_s,
            )
        self.admitted_after_queue += 1
        self.queue_wait_s += time.monotonic() - t0

    def leave(self, client: str, tokens: int = 0) -> None:
        """Give the slot back; the head of the queue gets it if it fits."""
        self.active -= 1
        self.active_tokens -= tokens
        if self.per_client:
            self._forget_client(client)
        if self._waiters:
            self._wake()

    # -- internals ---------------------------------------------------------------------------

    def _fits(self, tokens: int) -> bool:
        limit = self.max_tokens
        return limit is None or self.active == 0 or self.active_tokens + tokens <= limit

    def _wake(self) -> None:
        waiters = self._waiters
        while waiters:
            fut, tokens = waiters[0]
            if fut.done():  # timed out or cancelled; its owner already counted it off
                waiters.popleft()
                continue
            if self.active >= self.max_concurrent or not self._fits(tokens):
                return
            waiters.popleft()
            self.queued -= 1
            self.active += 1
            self.active_tokens += tokens
            fut.set_result(True)

    def _after_abandon(self) -> None:
        """A waiter gave up: the next one may fit now (token budget), and abandoned entries
        behind a long-lived head must not pile up."""
        waiters = self._waiters
        if len(waiters) > 2 * self.queued + 64:
            self._waiters = deque(w for w in waiters if not w[0].done())
        if self._waiters:
            self._wake()

    def _forget_client(self, client: str) -> None:
        if not self.per_client:
            return
        n = self._clients.get(client, 0) - 1
        if n > 0:
            self._clients[client] = n
        else:
            self._clients.pop(client, None)

    # -- lifecycle and observation -------------------------------------------------------------

    def close(self) -> None:
        """Shutting down: refuse new requests and release every queued one with a 503."""
        self.closed = True
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                self.queued -= 1
                fut.set_result(False)

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            active=self.active,
            active_tokens=self.active_tokens,
            queued=self.queued,
            clients=len(self._clients),
            admitted=self.admitted,
            admitted_after_queue=self.admitted_after_queue,
            queue_wait_s=self.queue_wait_s,
            shed=dict(self.shed),
            max_concurrent=self.max_concurrent,
            max_queue=self.max_queue,
            max_inflight_tokens=self.max_tokens,
            closed=self.closed,
        )


def is_shed(e: GatewayError) -> bool:
    """An admission refusal (as opposed to a bad request)."""
    return e.code in (
        ErrorCode.OVERLOADED,
        ErrorCode.QUEUE_TIMEOUT,
        ErrorCode.CLIENT_CONCURRENCY,
        ErrorCode.SHUTTING_DOWN,
    )
