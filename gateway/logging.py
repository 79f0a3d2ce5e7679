"""structlog set-up: JSON lines with the request id bound per request; filtered cheaply by level.

The JSON path is built for one access-log line per request at the default level (info): the
timestamp reuses the formatted second, msgspec renders the line, and the lines of a few
milliseconds leave in one write (`LineWriter`) instead of one flushed write each (`python -m
bench.python_cost --log-file F` measures a request with its line: 8 µs less than with
structlog's stock JSONRenderer, TimeStamper and PrintLogger, docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import time
from collections.abc import MutableMapping
from typing import IO, Any, Protocol

import msgspec
import structlog
from structlog.contextvars import merge_contextvars

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


class IsoStamp:
    """`timestamp`: ISO 8601 UTC with microseconds, as structlog's `TimeStamper(fmt="iso",
    utc=True)` writes it, formatting each second once."""

    __slots__ = ("_prefix", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._prefix = ""

    def __call__(self, _logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        now = time.time()
        sec = int(now)
        if sec != self._second:
            self._second = sec
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        event["timestamp"] = f"{self._prefix}.{int((now - sec) * 1_000_000):06d}Z"
        return event


class JsonBytes:
    """The event as one JSON line (bytes, no newline); what msgspec cannot encode is its repr."""

    __slots__ = ("_encode",)

    def __init__(self) -> None:
        self._encode = msgspec.json.Encoder(enc_hook=repr).encode

    def __call__(self, _logger: Any, _name: str, event: MutableMapping[str, Any]) -> bytes:
        return self._encode(event)


FLUSH_AFTER_S = 0.005  # how late a line may leave inside a running loop
FLUSH_LINES = 512  # ...or as soon as this many wait


class LineWriter:
    """structlog's logger for rendered lines: inside a running event loop the lines are joined
    and written once `FLUSH_AFTER_S` after the first of them (in order; sooner when
    `FLUSH_LINES` wait); outside a loop, and at exit, each is written at once.

    A timer rather than the end of the loop turn: a flush at the end of each turn costs a
    callback, a loop iteration and a write for nearly every request at one connection; the
    timer shares them between all the requests of those milliseconds (with one connection,
    non-streamed: ~5 µs less per request, docs/benchmarks.md "With logs at info")."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._stream = stream  # kept alive: its buffer closes with it
        self._file = _binary(stream)
        self._pending: list[bytes] = []
        self._scheduled: asyncio.AbstractEventLoop | None = None  # the loop that will flush
        atexit.register(self.flush)

    def msg(self, line: bytes) -> None:
        self._pending.append(line)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if self._scheduled is loop:
            if len(self._pending) >= FLUSH_LINES:
                self.flush()  # the timer finds nothing left, and does nothing
            return
        if self._scheduled is not None:  # due on a loop that no longer runs here: write now
            self.flush()
            return
        self._scheduled = loop
        loop.call_later(FLUSH_AFTER_S, self.flush)

    debug = info = warning = warn = error = critical = exception = fatal = failure = err = log = msg

    def flush(self) -> None:
        self._scheduled = None
        if not self._pending:
            return
        lines, self._pending = self._pending, []
        lines.append(b"")
        try:
            self._file.write(b"\n".join(lines))
            self._file.flush()
        except (OSError, ValueError):  # stderr closed or gone: nothing to tell it
            pass


class _TextSink:
    """Bytes into a text stream that has no binary buffer (an io.StringIO in place of stderr)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, data: bytes) -> None:
        self._stream.write(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        self._stream.flush()


class _Nowhere:
    """No stream to write to (stderr and stdout both closed: Python sets them to None)."""

    def write(self, data: bytes) -> None:
        pass

    def flush(self) -> None:
        pass


def _binary(stream: IO[str] | None) -> IO[bytes] | _TextSink | _Nowhere:
    if stream is None:  # stderr closed (`2>&-`): stdout, as structlog's PrintLogger did
        stream = sys.stdout
        if stream is None:
            return _Nowhere()
    buf = getattr(stream, "buffer", None)
    return buf if buf is not None else _TextSink(stream)


class _JsonChain(list[Any]):
    """The processors `configure(json=True)` installs, with the writer their lines go to: what
    `line_logger` recognises to write a hot line without structlog's wrapper around them."""

    def __init__(self, stamp: IsoStamp, render: JsonBytes, writer: LineWriter) -> None:
        super().__init__(
            (structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, stamp, render)
        )
        self.stamp, self.render, self.writer = stamp, render, writer


class _InfoLine:
    """`info(event, **fields)` through the processors of `configure(json=True)`, without
    structlog's bound-logger machinery around them (the lazy proxy, `bind`, the level method,
    the context copy and the processor loop: 137 of 8,509 bytecodes and 3.9 % of the machine
    instructions per logged request, `python -m bench.perf_report --cases "sglang nonstream
    logged" [--count instructions]`). The same steps in the
    same order, so the same line: the fields, `event`, the bound context variables, `level`,
    `timestamp`, rendered by msgspec, handed to the writer."""

    __slots__ = ("_encode", "_stamp", "_writer")

    def __init__(self, chain: _JsonChain) -> None:
        self._stamp, self._encode, self._writer = chain.stamp, chain.render._encode, chain.writer

    def info(self, event: str, **fields: Any) -> None:
        fields["event"] = event
        merge_contextvars(None, "info", fields)
        fields["level"] = "info"
        self._stamp(None, "info", fields)
        self._writer.msg(self._encode(fields))


class InfoLogger(Protocol):
    def info(self, event: str, **fields: Any) -> Any: ...


def line_logger(logger: structlog.typing.FilteringBoundLogger) -> InfoLogger:
    """What writes a hot path's info line (a request's access log line): `logger` itself,
    unless structlog runs `configure(json=True)`'s chain at info level or below, in which case
    a writer of the same line without structlog's wrapper (`_InfoLine`). Decided now, as
    structlog's own cache of a configured logger is (`cache_logger_on_first_use`); a test that
    captures logs (structlog.testing) never configures, and gets `logger`."""
    chain = structlog.get_config()["processors"]
    if isinstance(chain, _JsonChain) and info_enabled(logger):
        return _InfoLine(chain)
    return logger


def configure(level: str = "info", json: bool = True) -> None:
    wrapper = structlog.make_filtering_bound_logger(LEVELS.get(level.lower(), logging.INFO))
    if json:
        writer = LineWriter(sys.stderr)
        structlog.configure(
            processors=_JsonChain(IsoStamp(), JsonBytes(), writer),
            wrapper_class=wrapper,
            logger_factory=lambda *_: writer,
            cache_logger_on_first_use=True,
        )
        return
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=wrapper,
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


def debug_enabled(logger: structlog.typing.FilteringBoundLogger) -> bool:
    """Would `logger.debug` write anything (with the configuration in force now)?"""
    bound = logger.bind()
    check = getattr(bound, "is_enabled_for", None)
    return False if check is None else bool(check(logging.DEBUG))


def info_enabled(logger: structlog.typing.FilteringBoundLogger) -> bool:
    """Would `logger.info` write anything (with the configuration in force now)?"""
    bound = logger.bind()
    check = getattr(bound, "is_enabled_for", None)
    return True if check is None else bool(check(logging.INFO))
