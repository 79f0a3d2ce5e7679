"""Trace rows and the formats they are read from.

A row is one request: its arrival (seconds from the first row), its prompt length, its output
length and the ids of its prompt's blocks (`BLOCK_TOKENS` tokens each, the last one possibly
partial). Two rows that share a block id share that block's tokens; the Mooncake traces chain
their ids (an id fixes every block before it), so sharing is always a shared prefix.

Formats:
  * Mooncake JSONL (kvcache-ai/Mooncake FAST25-release/traces, Apache-2.0): one JSON object per
    line with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks);
  * CSV with a header: `timestamp_ms,input_length,output_length` and optional `hash_ids`
    (ids separated by spaces) and `session_id`; a row without ids gets blocks of its own.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

BLOCK_TOKENS = 512


class Row(msgspec.Struct, frozen=True):
    t_s: float  # arrival, seconds after the first row
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session_id: str | None = None


class TraceError(ValueError):
    """A trace that cannot be replayed as it is (the message names the row)."""


class _MooncakeLine(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int] = []
    session_id: str | None = None


def blocks_needed(input_length: int, block_tokens: int = BLOCK_TOKENS) -> int:
    return max(1, math.ceil(input_length / block_tokens))


def _check(n: int, row: Row, block_tokens: int) -> None:
    if row.input_length < 1:
        raise TraceError(f"row {n}: input_length {row.input_length} < 1")
    if row.output_length < 1:
        raise TraceError(f"row {n}: output_length {row.output_length} < 1")
    need = blocks_needed(row.input_length, block_tokens)
    if len(row.hash_ids) != need:
        raise TraceError(
            f"row {n}: input_length {row.input_length} spans {need} blocks of {block_tokens} tokens "
            f"but the row has {len(row.hash_ids)} hash_ids"
        )


def _fill_ids(rows: list[tuple[float, int, int, list[int], str | None]], block_tokens: int) -> list[Row]:
    """Rows; one without ids gets fresh ones (above every id in the trace): no sharing."""
    top = max((max(ids) for *_, ids, _ in rows if ids), default=-1) + 1
    out: list[Row] = []
    for ts, inp, outp, ids, sid in rows:
        if not ids:
            n = blocks_needed(inp, block_tokens)
            ids = list(range(top, top + n))
            top += n
        out.append(Row(ts, inp, outp, tuple(ids), sid))
    return out


def _rezero(rows: list[Row]) -> list[Row]:
    if not rows:
        return rows
    t0 = rows[0].t_s
    return [msgspec.structs.replace(r, t_s=r.t_s - t0) for r in rows]


def load_mooncake(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Row]:
    decoder = msgspec.json.Decoder(_MooncakeLine)
    raw: list[tuple[float, int, int, list[int], str | None]] = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                m = decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{n}: {exc}") from None
            raw.append((m.timestamp / 1000.0, m.input_length, m.output_length, m.hash_ids, m.session_id))
    return _finish(raw, block_tokens, str(path))


def load_csv(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Row]:
    raw: list[tuple[float, int, int, list[int], str | None]] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"timestamp_ms", "input_length", "output_length"} - set(reader.fieldnames or ())
        if missing:
            raise TraceError(f"{path}: the header lacks {', '.join(sorted(missing))}")
        for n, rec in enumerate(reader, 2):
            try:
                ids = [int(x) for x in (rec.get("hash_ids") or "").split()]
                raw.append(
                    (
                        float(rec["timestamp_ms"]) / 1000.0,
                        int(rec["input_length"]),
                        int(rec["output_length"]),
                        ids,
                        rec.get("session_id") or None,
                    )
                )
            except ValueError as exc:
                raise TraceError(f"{path}:{n}: {exc}") from None
    return _finish(raw, block_tokens, str(path))


def _finish(
    raw: list[tuple[float, int, int, list[int], str | None]], block_tokens: int, where: str
) -> list[Row]:
    if not raw:
        raise TraceError(f"{where}: no rows")
    if any(b[0] < a[0] for a, b in itertools.pairwise(raw)):
        raw.sort(key=lambda r: r[0])
    rows = _fill_ids(raw, block_tokens)
    for n, row in enumerate(rows, 1):
        _check(n, row, block_tokens)
    return _rezero(rows)


def load(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[Row]:
    """By extension: `.csv` is CSV, anything else Mooncake JSONL."""
    if str(path).lower().endswith(".csv"):
        return load_csv(path, block_tokens)
    return load_mooncake(path, block_tokens)


def select(rows: Sequence[Row], start: int = 0, end: int | None = None) -> list[Row]:
    """Rows [start, end) with arrivals counted from the first of them."""
    return _rezero(list(rows[start:end]))


def scale_arrivals(rows: Iterable[Row], rate: float) -> list[Row]:
    """Arrivals `rate` times as fast (2.0: twice the requests per second)."""
    if rate <= 0:
        raise ValueError("rate multiplier must be > 0")
    return [msgspec.structs.replace(r, t_s=r.t_s / rate) for r in rows]


def write_csv(rows: Iterable[Row], path: str | Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp_ms", "input_length", "output_length", "hash_ids", "session_id"])
        for r in rows:
            w.writerow(
                [
                    round(r.t_s * 1000.0, 3),
                    r.input_length,
                    r.output_length,
                    " ".join(map(str, r.hash_ids)),
                    r.session_id or "",
                ]
            )
