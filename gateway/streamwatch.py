"""Watch a decode stream on its way to the client without slowing it down.

Only two places of a stream are held back:

- the bytes before the first event that carries a token, until that token has been checked
  against the prefill's (a greedy request whose decode starts on another token used a KV that
  is not this prompt's: nothing of it may reach the client);
- the bytes from the event that carries a `finish_reason` to the end (the usage event and
  `[DONE]` follow at once), until the whole answer has been checked; a bad answer ends with an
  error event instead of a clean `[DONE]`.

Everything in between is passed on as it arrives; per chunk the cost is a few substring
tests. Which events end a stream, and how a usage chunk the client did not ask for is dropped,
is the engine adapter's knowledge (`stream_end_markers`, `without_usage_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from common.summary import Summary

_SEP = b"\n\n"
Summarize = Callable[[list[bytes]], Summary]
Check = Callable[[Summary], str | None]


def _iter_payloads(events: bytes) -> Iterator[bytes]:
    """The `data:` payloads of whole events, one at a time (lazily: a caller that stops early
    does not split the rest)."""
    start = 0
    n = len(events)
    while start < n:
        end = events.find(b"\n", start)
        if end < 0:
            end = n
        if events.startswith(b"data:", start):
            p = events[start + 5 : end].strip()
            if p and p != b"[DONE]":
                yield p
        start = end + 1


def _payloads(events: bytes) -> list[bytes]:
    out = []
    for line in events.split(b"\n"):
        if line.startswith(b"data:"):
            p = line[5:].strip()
            if p and p != b"[DONE]":
                out.append(p)
    return out


class StreamStopped(Exception):
    """Raised by `StreamWatch.feed` when the first token fails its check: a pipe whose sink
    raises stops reading and aborts the upstream connection. `StreamWatch.violation` says why."""


class StreamWatch:
    __slots__ = (
        "_buf",
        "_check_end",
        "_check_first",
        "_drop_usage",
        "_ends",
        "_first",
        "_head",
        "_held",
        "_passing",
        "_state",
        "_summarize",
        "_write",
        "failed",
        "summary",
        "violation",
    )

    def __init__(
        self,
        write: Callable[[bytes], None],
        summarize: Summarize,
        check_first: Check,
        check_end: Check,
        *,
        ends: tuple[bytes, ...],
        drop_usage: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self._write = write
        # what marks the events that end a stream (a finish reason, an error event): the engine
        # adapter's `stream_end_markers`
        self._ends = ends
        # the usage chunk was asked for by the gateway, not the client: this drops it (the
        # adapter's `without_usage_chunk`)
        self._drop_usage = drop_usage
        self._summarize = summarize
        self._check_first = check_first
        self._check_end = check_end
        self._state = 0  # 0: before the first token, 1: passing, 2: holding the end
        # state 1 with no incomplete tail and no violation: whole events pass at once (`feed`)
        self._passing = False
        self._buf = b""  # incomplete tail (all states) / everything held (states 0 and 2)
        self._head: list[bytes] = []  # payloads seen before passing
        self._held = b""
        self._first: Summary | None = None
        self.violation: str | None = None  # a guard failed
        self.failed: str | None = None  # the engine failed before its first token (nothing was sent)
        self.summary: Summary | None = None  # the whole answer's, once `finish` read it

    def write_to(self, write: Callable[[bytes], None]) -> None:
        """Where the passed bytes go from now on (e.g. straight to the client once the first
        write has started the response)."""
        self._write = write

    def feed(self, data: bytes) -> None:
        # (`data[-2:] == _SEP`: `endswith` parses its arguments by format on Python 3.11)
        if self._passing and data[-2:] == _SEP:
            # the hot path: whole events in the middle of a stream
            for marker in self._ends:
                # (`partition`, neither `in`, which makes and drops a TypeError on Python 3.11
                # (common/jsonbytes.py), nor `find`, whose arguments are parsed by format; a
                # miss returns `data` itself in the tuple, no copy)
                if data.partition(marker)[1]:
                    break
            else:
                self._write(data)
                return
        try:
            self._feed(data)
        finally:
            self._passing = self._state == 1 and not self._buf and self.violation is None

    def _feed(self, data: bytes) -> None:
        if self.violation is not None:
            return
        buf = self._buf + data if self._buf else data
        cut = buf.rfind(_SEP)
        if cut < 0:
            self._buf = buf
            return
        if cut + 2 == len(buf):  # the usual case: whole events, no copy
            complete, self._buf = buf, b""
        else:
            complete, self._buf = buf[: cut + 2], buf[cut + 2 :]
        if self._state == 0:
            self._held += complete
            # event by event, up to the first that carries a token: when a whole stream arrives
            # in one piece, only its head is decoded here (the rest passes, its end is checked)
            first = None
            for payload in _iter_payloads(complete):
                self._head.append(payload)
                s = self._summarize(self._head)
                if s.first_text is not None or s.first_token_id is not None or s.parsed:
                    first = s
                    break
            if first is None:
                return  # no token yet (a role-only chat event, say)
            self._first = first
            self.violation = self._check_first(first)
            if self.violation is not None:
                raise StreamStopped(self.violation)
            complete, self._held = self._held, b""
            self._state = 1
            # fall through: the held head may already contain the finish event
        if self._state == 1:
            at = -1
            for marker in self._ends:
                i = complete.find(marker)
                if i >= 0 and (at < 0 or i < at):
                    at = i
            if at < 0:
                self._write(complete)
                return
            start = complete.rfind(b"data:", 0, at)
            start = max(start, 0)
            if start:
                self._write(complete[:start])
            self._held = complete[start:]
            self._state = 2
            return
        self._held += complete

    def finish(self) -> str | None:
        """At the end of the upstream stream: check the answer, then release what was held.
        Returns the guard violation, if any; `failed` says the engine itself failed."""
        if self.violation is not None:
            return self.violation
        self._passing = False
        held = self._held + self._buf
        # No usage in the stream (the gateway asks for it on OpenAI routes; /generate events
        # carry their count): the "finished early" check is skipped, not guessed from the
        # number of events, which is no token count (SGLang sends several tokens per event
        # with --stream-interval > 1 or a held-back multi-byte character; role-only events).
        end = self.summary = self._summarize(self._head + _payloads(held))
        if self._first is not None:
            end.first_text = self._first.first_text
            end.first_token_id = self._first.first_token_id
            end.parsed = end.parsed or self._first.parsed
        if end.error is not None and self._state != 1:
            # the engine's own error event (or abort): not relayed; before the first token the
            # request can still be retried elsewhere, after it the stream ends with our error
            self.failed = end.error
            self._held = self._buf = b""
            return None
        self.violation = self._check_end(end) if self._state == 2 else None
        if self.violation is None and held:
            drop = self._drop_usage
            self._write(drop(held) if drop is not None else held)
        self._held = self._buf = b""
        return self.violation
