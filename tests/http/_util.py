"""Helpers for the data-plane tests: a raw HTTP/1.1 client and response reader."""

from __future__ import annotations

import asyncio
import socket


class RawResponse:
    def __init__(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, chunks: list[bytes]
    ) -> None:
        self.status = status
        self.headers = headers
        self.body = body
        self.chunks = chunks

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n == name:
                return v
        return None


async def read_response(reader: asyncio.StreamReader, *, head: bool = False) -> RawResponse:
    """Read one response: Content-Length, chunked, or to EOF."""
    while True:
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = []
        for line in lines[1:]:
            n, _, v = line.partition(b":")
            headers.append((n.strip().lower(), v.strip()))
        if status >= 200:
            break
    resp = RawResponse(status, headers, b"", [])
    if head or status in (204, 304):
        return resp
    cl = resp.header(b"content-length")
    if cl is not None:
        resp.body = await reader.readexactly(int(cl))
    elif resp.header(b"transfer-encoding") == b"chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            parts.append(data[:-2])
        resp.chunks = parts
        resp.body = b"".join(parts)
    else:
        resp.body = await reader.read()
    return resp


async def request(
    port: int, raw: bytes, *, head: bool = False
) -> tuple[RawResponse, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    resp = await read_response(reader, head=head)
    return resp, reader, writer


async def is_closed(reader: asyncio.StreamReader, timeout: float = 2.0) -> bool:  # noqa: ASYNC109
    """True if the peer closed (EOF or reset) within ``timeout``."""
    try:
        data = await asyncio.wait_for(reader.read(1), timeout)
    except TimeoutError:  # (first: a TimeoutError is an OSError)
        return False
    except (ConnectionError, OSError):
        return True
    return data == b""


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return int(port)
