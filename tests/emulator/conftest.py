from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from emulator.api import EmulatorHandle, EmulatorSpec, start_emulator
from emulator.model import ALPHABET_IDS
from emulator.tokenizer import BYTE_OFFSET

Factory = Callable[..., Awaitable[EmulatorHandle]]


@pytest.fixture
async def emu() -> AsyncIterator[Factory]:
    handles: list[EmulatorHandle] = []

    async def make(engine: str, role: str, **kw: Any) -> EmulatorHandle:
        h = await start_emulator(EmulatorSpec(engine=engine, role=role, **kw))  # type: ignore[arg-type]
        handles.append(h)
        return h

    yield make
    for h in handles:
        await h.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    parts = raw.split("\n\n")[:-1]
    assert all(p.startswith("data: ") for p in parts), parts
    return [p[len("data: ") :] for p in parts]


def drawn_instead(masked: set[str] | str) -> str:
    """The character the emulated model draws in place of a stop id that a minimum length
    masks (`masked`: the stop ids' characters): the first of its alphabet not masked."""
    return next(chr(t - BYTE_OFFSET) for t in ALPHABET_IDS if chr(t - BYTE_OFFSET) not in masked)
