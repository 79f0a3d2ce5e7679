"""The JSON log path: structlog's fields and format, msgspec rendering, one write per loop turn."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import re
from typing import Any

import structlog

from gateway.logging import (
    FLUSH_AFTER_S,
    FLUSH_LINES,
    IsoStamp,
    JsonBytes,
    LineWriter,
    configure,
    get_logger,
    line_logger,
)


class CountingBuffer(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, b: Any) -> int:
        self.writes += 1
        return super().write(b)


class Stream:
    """A text stream as sys.stderr is, with the binary buffer the writer uses."""

    def __init__(self) -> None:
        self.buffer = CountingBuffer()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.buffer.getvalue().splitlines()]


def test_the_timestamp_is_structlogs_iso_format() -> None:
    ours = IsoStamp()(None, "info", {})["timestamp"]
    theirs = structlog.processors.TimeStamper(fmt="iso", utc=True)(None, "info", {})["timestamp"]
    pattern = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"
    assert re.fullmatch(pattern, ours) and re.fullmatch(pattern, theirs), (ours, theirs)
    when = [dt.datetime.fromisoformat(x.replace("Z", "+00:00")) for x in (ours, theirs)]
    assert abs((when[1] - when[0]).total_seconds()) < 1.0  # the same clock, in UTC


def test_a_value_msgspec_cannot_encode_is_its_repr() -> None:
    class Odd:
        def __repr__(self) -> str:
            return "<odd>"

    line = JsonBytes()(None, "info", {"event": "x", "what": Odd(), "n": 1, "none": None})
    assert json.loads(line) == {"event": "x", "what": "<odd>", "n": 1, "none": None}


def test_lines_of_a_few_milliseconds_leave_in_one_write_in_order() -> None:
    s = Stream()
    w = LineWriter(s)  # type: ignore[arg-type]

    async def main() -> tuple[int, int, int]:
        w.msg(b'{"i":0}')
        await asyncio.sleep(0)  # another loop turn: lines wait for the timer, not the turn
        for i in range(1, 5):
            w.msg(b'{"i":%d}' % i)
        before = s.buffer.writes
        await asyncio.sleep(FLUSH_AFTER_S * 3)
        after = s.buffer.writes
        w.msg(b'{"i":5}')
        await asyncio.sleep(FLUSH_AFTER_S * 3)
        return before, after, s.buffer.writes

    assert asyncio.run(main()) == (0, 1, 2)
    assert [x["i"] for x in s.lines()] == list(range(6))


def test_many_waiting_lines_leave_without_waiting_for_the_timer() -> None:
    s = Stream()
    w = LineWriter(s)  # type: ignore[arg-type]

    async def main() -> int:
        for i in range(FLUSH_LINES):
            w.msg(b'{"i":%d}' % i)
        return s.buffer.writes

    assert asyncio.run(main()) == 1
    assert [x["i"] for x in s.lines()] == list(range(FLUSH_LINES))


def test_outside_a_loop_each_line_is_written_at_once() -> None:
    s = Stream()
    w = LineWriter(s)  # type: ignore[arg-type]
    w.msg(b'{"a":1}')
    assert s.lines() == [{"a": 1}]


def test_a_line_left_due_on_a_loop_that_stopped_is_written_with_the_next() -> None:
    s = Stream()
    w = LineWriter(s)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()

    def one() -> None:
        w.msg(b'{"i":0}')  # due at the end of this turn, which never comes:
        loop.stop()  # the loop stops after this turn's callbacks

    loop.call_soon(one)
    loop.run_forever()
    loop.close()
    assert s.lines() == []
    w.msg(b'{"i":1}')  # no loop: written at once, with anything left
    assert [x["i"] for x in s.lines()] == [0, 1]

    async def other() -> None:
        w.msg(b'{"i":2}')
        await asyncio.sleep(FLUSH_AFTER_S * 3)

    asyncio.run(other())
    assert [x["i"] for x in s.lines()] == [0, 1, 2]


def test_configure_writes_structlogs_fields_as_json_lines(monkeypatch: Any) -> None:
    s = io.TextIOWrapper(CountingBuffer(), encoding="utf-8")
    monkeypatch.setattr("sys.stderr", s)
    saved = structlog.get_config()
    try:
        configure("info")
        log = get_logger("test")

        async def main() -> None:
            log.info("request.done", request_id="r1", duration_ms=1.5, failed=None)
            log.debug("not.written")
            log.warning("slow", worker="http://w")
            await asyncio.sleep(FLUSH_AFTER_S * 3)

        asyncio.run(main())
    finally:
        structlog.configure(**saved)
    assert isinstance(s.buffer, CountingBuffer)
    lines = [json.loads(x) for x in s.buffer.getvalue().splitlines()]
    assert [(x["event"], x["level"]) for x in lines] == [("request.done", "info"), ("slow", "warning")]
    assert lines[0]["request_id"] == "r1" and lines[0]["duration_ms"] == 1.5 and lines[0]["failed"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", lines[0]["timestamp"])
    assert s.buffer.writes == 1


def test_a_stderr_without_a_binary_buffer_gets_text() -> None:
    s = io.StringIO()
    w = LineWriter(s)
    w.msg(b'{"caf\\u00e9":"\xc3\xa9"}')
    assert json.loads(s.getvalue()) == {"café": "é"}


def test_a_closed_stderr_logs_to_stdout_and_never_crashes(monkeypatch: Any) -> None:
    """`2>&-`: Python sets sys.stderr to None; the first line crashed `serve` before it listened."""
    out = Stream()
    monkeypatch.setattr("sys.stdout", out)
    w = LineWriter(None)
    w.msg(b'{"a":1}')
    assert out.lines() == [{"a": 1}]
    monkeypatch.setattr("sys.stdout", None)
    LineWriter(None).msg(b'{"a":2}')  # nowhere to write: dropped


def test_the_access_line_writer_writes_structlogs_line(monkeypatch: Any) -> None:
    """`line_logger` skips structlog's wrapper for the hot info line; the line must be the one
    structlog's own chain writes (same keys in the same order, context variables included)."""
    s = io.TextIOWrapper(CountingBuffer(), encoding="utf-8")
    monkeypatch.setattr("sys.stderr", s)
    saved = structlog.get_config()
    try:
        configure("info")
        log = get_logger("test")
        line = line_logger(log)
        assert line is not log

        async def main() -> None:
            structlog.contextvars.bind_contextvars(process=1, request_id="bound")
            try:
                for writer in (log, line):
                    writer.info("request.done", request_id="r1", duration_ms=1.5, worker=object)
            finally:
                structlog.contextvars.clear_contextvars()
            await asyncio.sleep(FLUSH_AFTER_S * 3)

        asyncio.run(main())
    finally:
        structlog.configure(**saved)
    assert isinstance(s.buffer, CountingBuffer)
    raw = s.buffer.getvalue().splitlines()
    assert len(raw) == 2
    stamp = re.compile(rb'"timestamp":"[^"]*"')
    assert stamp.sub(b"", raw[0]) == stamp.sub(b"", raw[1])
    assert list(json.loads(raw[1])) == [
        "request_id",
        "duration_ms",
        "worker",
        "event",
        "process",
        "level",
        "timestamp",
    ]


def test_the_access_line_writer_is_structlogs_logger_unless_the_json_chain_writes_info() -> None:
    saved = structlog.get_config()
    try:
        log = get_logger("test")
        assert line_logger(log) is log  # not configured (as under structlog.testing.capture_logs)
        configure("warning")
        log = get_logger("test")
        assert line_logger(log) is log  # info is not written
        configure("info", json=False)
        log = get_logger("test")
        assert line_logger(log) is log  # the console renderer
    finally:
        structlog.configure(**saved)
