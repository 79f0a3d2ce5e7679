"""`n > 1` and batches as requests of one prompt and one sample each, merged back into one answer.

Why: SGLang 0.5.23 in P/D gives every sample of an `n > 1` request its prompt's bootstrap room
(`_handle_batch_request` copies element i for each sample), a room transfers KV once, and the
other samples' decodes wait for KV that never comes (300 s by default; sglang PRs #26486 and
#30723, seen on the real engine in tests/e2e/test_batches.py). No choice of rooms on the wire
avoids it. So the gateway sends sample j as its own request (`n` = 1, its own room, `seed + j`
when a seed is given, so seeded samples differ and are reproducible), each a full handoff with
its own guards, and merges the answers as the engine would have: choice (or `/generate` output)
`k = prompt_index * n + j`, completion tokens summed, prompt tokens counted once per prompt, one
usage chunk and one `[DONE]` at the end of a stream.

Batches are split the same way, one request per prompt (and per sample): a batch sent whole
is one engine request with one answer per prompt, which the decode-consistency guard cannot
check one by one, so a broken handoff of any prompt would reach the client as a 200 (a probe
saw 51 of 240 batch answers wrong under faults). Each unit `k = prompt_index * n + j` is a
single-prompt, single-sample handoff with its own guards.

The SGLang adapter cuts the request into its units (`split_units`, adapters/_split.py); the
split shape runs them (gateway/orchestration/split.py). `SampleSink` stands in for the client's
responder in each sub-request's relay; `SampleMerger` writes to the real one. Streams are
merged event by event as they come (each event decoded, its index renumbered, re-encoded);
whole answers when every sample is in.

A stream starts only once every unit of the first wave (the `split_concurrency` units started at
once) has passed the points where an engine refuses a request for its own fault: its prefill's
verdict, its decode's status and first event (a unit arrives with its first bytes for the
client). Until then the merged events are held. A direct SGLang 0.5.23 server validates every
prompt of a batch before it streams any (tokenizer_manager.py:2108 `_handle_batch_request`
tokenizes each, :1271 `_validate_one_request`; a ValueError ends the request first), and its
OpenAI routes await the first chunk before the 200 (serving_completions.py:208-212,
serving_chat.py:2422-2427): so a refused unit is the request's error, as when it is not streamed,
never an error event after other units' tokens, whichever leg answered first. The cost is the
first wave's slowest first token instead of its fastest. A unit started later (past
`split_concurrency`) can still be refused mid-stream: the stream then ends with an error event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from common.request import ParsedRequest
from common.workers import RouteKind
from gateway.http.server import Responder

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"
_HEAD = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


class SampleMerger:
    """The client's one answer, from `n` sub-requests' answers."""

    def __init__(
        self,
        req: ParsedRequest,
        res: Responder,
        *,
        first_wave: int | None = None,
        head: Sequence[tuple[bytes, bytes]] = _HEAD,
    ) -> None:
        """`first_wave`: how many units start at once (all by default): a stream starts when
        each of them has arrived; `head`: the stream's headers when no unit gave any."""
        self.res = res
        self.n = req.n
        self.units = req.units
        wave = self.units if first_wave is None else min(self.units, first_wave)
        self._waiting = set(range(wave))  # first-wave units that have not arrived yet
        self._held: list[bytes] | None = []  # merged bytes while the stream waits; None once started
        self._head = head
        self._head_given = False
        self.generate = req.route is RouteKind.GENERATE
        self.bodies: list[bytes | None] = [None] * self.units
        self.headers: Sequence[tuple[bytes, bytes]] = ()  # a sample's answer headers (type, id)
        self.usage: list[dict[str, Any] | None] = [None] * self.units
        self._tail: list[bytes] = [b""] * self.units
        self._usage_event: dict[str, Any] | None = None  # a usage chunk's other fields (id, model...)
        self._stream_ids: tuple[Any, Any] | None = None  # (id, created) of the first event: all carry them
        self.first_byte_at = 0.0

    def sink(self, j: int, task: asyncio.Task[None]) -> SampleSink:
        return SampleSink(self, j, task)

    # -- whole answers -------------------------------------------------------------------------

    def send_whole(self) -> None:
        """Every sample is in: the merged answer goes out."""
        outs = [_decode.decode(b) if b is not None else None for b in self.bodies]
        body = self._merge_generate(outs) if self.generate else self._merge_openai(outs)
        self.first_byte_at = time.monotonic()
        self.res.send(200, self.headers, body)

    def _merge_generate(self, outs: list[Any]) -> bytes:
        merged: list[Any] = []
        for k, o in enumerate(outs):
            item = o[0] if isinstance(o, list) and len(o) == 1 else o
            if isinstance(item, dict) and "index" in item:
                item["index"] = k
            merged.append(item)
        return _encode(merged)

    def _merge_openai(self, outs: list[Any]) -> bytes:
        first = outs[0]
        choices: list[Any] = []
        for k, o in enumerate(outs):
            for c in o.get("choices") or ():
                c["index"] = k
                choices.append(c)
        first["choices"] = choices
        usage = _sum_usage([o.get("usage") for o in outs], self.n)
        if usage is not None:
            first["usage"] = usage
        return _encode(first)

    # -- streams -------------------------------------------------------------------------------

    def start(self, headers: Sequence[tuple[bytes, bytes]]) -> None:
        """A unit's stream began (its headers are the merged stream's, the first unit's)."""
        if not self._head_given:
            self._head, self._head_given = headers, True

    def arrived(self, j: int) -> None:
        """Unit j is past its engines' refusals (its first bytes for the client, or its end):
        once every unit of the first wave is, the stream starts with what was held."""
        waiting = self._waiting
        if j in waiting:
            waiting.discard(j)
            if not waiting:
                self._open()

    def _open(self) -> None:
        held = self._held
        if held is None:
            return
        self._held = None
        if not self.res.started:
            self.res.start_stream(200, self._head, b"".join(held))
            self.first_byte_at = time.monotonic()

    def _write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        else:
            self.res.write(data)

    def feed(self, j: int, data: bytes) -> None:
        """Bytes of sample j's stream: its complete events, renumbered, to the client."""
        buf = self._tail[j] + data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._tail[j] = buf
            return
        self._tail[j] = buf[cut + 2 :]
        out: list[bytes] = []
        for event in buf[: cut + 2].split(b"\n\n"):
            line = event.strip()
            if not line.startswith(b"data:"):
                if line:
                    out.append(line + b"\n\n")  # comments, other fields: as they are
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue  # one [DONE] for all, at the end
            try:
                ev = _decode.decode(payload)
            except msgspec.DecodeError:
                ev = None
            if not isinstance(ev, dict):
                out.append(line + b"\n\n")  # not an event to renumber: as it is
            elif self._renumber(j, ev):
                out.append(b"data: " + _encode(ev) + b"\n\n")
        if out:
            self._write(b"".join(out))

    def _renumber(self, j: int, ev: dict[str, Any]) -> bool:
        """Sample j's event as the merged stream's; False to drop it (a usage-only chunk, summed
        into the one at the end)."""
        if self.generate:
            ev["index"] = j
            return True
        # one stream, one id: every chunk carries the first event's id and created, whichever
        # sample it comes from (each sample's engine named its own)
        if self._stream_ids is None:
            self._stream_ids = (ev.get("id"), ev.get("created"))
        elif "id" in ev:
            ev["id"], ev["created"] = self._stream_ids
        usage = ev.get("usage")
        choices = ev.get("choices")
        if not choices:
            # the sample's usage chunk (the client asked for usage): summed into one at the end
            if usage is not None:
                self.usage[j] = usage
                if self._usage_event is None:
                    self._usage_event = {k: v for k, v in ev.items() if k not in ("choices", "usage")}
            return usage is None
        # a content chunk keeps its usage (continuous_usage_stats): its own choice's tokens so
        # far, which is what SGLang puts there for each index of an `n > 1` or batch stream
        for c in choices:
            c["index"] = j
        return True

    def end_stream(self) -> None:
        """Every sample's stream ended: the summed usage (when the samples sent theirs) and one
        [DONE]."""
        self._open()  # (every unit ended: those that sent nothing arrived with their end)
        out: list[bytes] = []
        usage = _sum_usage(self.usage, self.n)
        if usage is not None:
            ev = dict(self._usage_event or {})
            ev["choices"] = []
            ev["usage"] = usage
            out.append(b"data: " + _encode(ev) + b"\n\n")
        out.append(_DONE)
        self.res.write(b"".join(out))
        self.res.end()


def _sum_usage(usages: list[Any], n: int) -> dict[str, Any] | None:
    """Usage of the units' answers as one, as the engine counts a batch with `n` samples:
    each prompt's tokens once (from its first sample), completion tokens summed."""
    present = [u for u in usages if isinstance(u, dict)]
    if not present:
        return None
    out = dict(present[0])
    completion = sum(int(u.get("completion_tokens") or 0) for u in present)
    prompt = sum(
        int(u.get("prompt_tokens") or 0) for k, u in enumerate(usages) if k % n == 0 and isinstance(u, dict)
    )
    out["prompt_tokens"] = prompt
    out["completion_tokens"] = completion
    out["total_tokens"] = prompt + completion
    firsts = [u for k, u in enumerate(usages) if k % n == 0 and isinstance(u, dict)]
    details = {k for u in present for k, v in u.items() if k.endswith("_details") and isinstance(v, dict)}
    # (over every answer's keys: one with no cache hit may say null where a later one counts)
    for key in sorted(details):
        # as SGLang's UsageProcessor: a prompt's cached tokens once (its first sample's),
        # the completion's counts (reasoning, speculative) over every answer
        over = firsts if key == "prompt_tokens_details" else present
        out[key] = _sum_details([u.get(key) for u in over])
    return out


def _sum_details(parts: list[Any]) -> dict[str, Any]:
    """A usage `*_details` object over several answers, its counts summed."""
    out: dict[str, Any] = {}
    for part in parts:
        if not isinstance(part, dict):
            continue
        for k, v in part.items():
            if isinstance(v, int) and not isinstance(v, bool) and isinstance(out.get(k, 0), int):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


class SampleSink:
    """Sample j's stand-in for the client's responder (what the orchestrator's relay uses)."""

    def __init__(self, merger: SampleMerger, j: int, task: asyncio.Task[None]) -> None:
        self._m = merger
        self._j = j
        self.started = False
        self.task = task

    @property
    def closed(self) -> bool:
        return self._m.res.closed

    def send(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> None:
        self.started = True
        self._m.bodies[self._j] = body
        self._m.headers = headers

    def start_stream(self, status: int, headers: Sequence[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self.started = True
        self._m.start(headers)
        if first:
            self._m.feed(self._j, first)
            self._m.arrived(self._j)

    def write(self, data: bytes) -> None:
        if data:
            self._m.feed(self._j, data)
            self._m.arrived(self._j)

    def end(self) -> None:
        self._m.arrived(self._j)
        self._m.res.uncork()  # the relay corked around the stream's held end

    def cork(self) -> None:
        self._m.res.cork()

    def uncork(self) -> None:
        self._m.res.uncork()

    def add_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._m.res.add_flow_listener(pause, resume)

    def remove_flow_listener(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._m.res.remove_flow_listener(pause, resume)
