"""Every async test runs on uvloop, the loop the gateway and the emulator use in production."""

from __future__ import annotations

import asyncio

import pytest
import uvloop


@pytest.fixture(scope="session")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    return uvloop.EventLoopPolicy()
