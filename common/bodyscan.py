"""A large request body's cost, measured in slices before it is decoded.

msgspec decodes a body in one call that holds the event loop (and the GIL: a thread does not
help) for as long as it takes, and that time grows with the number of JSON values, not the
bytes: on a 2-core machine 16 MiB of tiny prompts (`["a","a",...]`) took 50-130 ms to skip and
over 500 ms to read, and a batch of 4 M id lists 4 s. So a body over `SCAN_FROM` bytes is first
walked here in windows of `WINDOW` bytes, the event loop free between them, with C-speed byte
operations only (no Python object per value): its UTF-8 is checked (an incremental decoder), and
its JSON values are counted, strings apart from the punctuation inside them. A body holding
more than `limits.max_json_values` is refused (413) before any decode; one within it decodes in
a time that limit bounds.

The count: escapes are dropped (`\\\\`, then `\\"`), so every `"` left delimits a string;
outside strings each `,`, `[` and `{` is one value more (each element but a container's first
follows a comma, each container opens once); each string is one, and every two backslashes
(escapes slow a decoder down too: 13 MiB of them took 40 ms to skip) one more. A window never ends on a
backslash, so no escape is cut in two. For valid JSON this is within a factor of two of the
values msgspec meets; for invalid JSON the figure is meaningless, and msgspec refuses the body
at its first error, whose cost the figure still bounds (a string that never closes is skipped
at memchr speed).
"""

from __future__ import annotations

import asyncio
import codecs

from common.errors import BadRequest, ErrorCode

SCAN_FROM = 64 * 1024  # smaller bodies hold at most ~32 K values: decoded at once
WINDOW = 64 * 1024  # bytes per slice (~0.1 ms for prose, ~3 ms for a window of tiny strings)

_BACKSLASH = 0x5C


class TooManyValues(BadRequest):
    """413: the body holds more JSON values than `limits.max_json_values`."""

    status = 413
    code = ErrorCode.REQUEST_TOO_LARGE


async def scan_body(body: bytes, max_values: int) -> None:
    """Check a large body in slices (the event loop runs between them): valid UTF-8, and at
    most `max_values` JSON values (`TooManyValues` past it). Raises BadRequest for bad UTF-8."""
    decoder = None if body.isascii() else codecs.getincrementaldecoder("utf-8")()
    n = len(body)
    start = 0
    in_string = False
    values = 1  # the top-level value
    while start < n:
        end = min(n, start + WINDOW)
        while end < n and body[end - 1] == _BACKSLASH:  # never cut an escape in two
            end += 1
        chunk = body[start:end]
        if decoder is not None:
            held = len(decoder.getstate()[0])  # a character's first bytes, from the last slice
            try:
                decoder.decode(chunk, final=end == n)
            except UnicodeDecodeError as e:
                raise BadRequest(
                    f"request body is not valid UTF-8: {e.reason} at byte {start - held + e.start}"
                ) from None
        escapes = chunk.count(b"\\")
        if escapes:
            # an escape costs a decoder about half what a value does (`\\uXXXX` text, as
            # Python's json.dumps writes every non-ASCII character, counts too)
            values += escapes // 2
            chunk = chunk.replace(b"\\\\", b"").replace(b'\\"', b"")
        quotes = chunk.count(b'"')
        if quotes == 0:
            if not in_string:
                values += _punctuation(chunk)
        else:
            opened = (quotes + (0 if in_string else 1)) // 2  # strings that start in this window
            if values + opened > max_values:
                raise _too_many(max_values)
            parts = chunk.split(b'"')
            values += opened + _punctuation(b"".join(parts[1 if in_string else 0 :: 2]))
            in_string ^= quotes % 2 == 1
        if values > max_values:
            raise _too_many(max_values)
        start = end
        if start < n:
            await asyncio.sleep(0)


def _punctuation(structure: bytes) -> int:
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{")


def _too_many(max_values: int) -> TooManyValues:
    return TooManyValues(
        f"the request body holds more than {max_values} JSON values (limits.max_json_values): "
        "send fewer prompts or token ids per request",
    )
