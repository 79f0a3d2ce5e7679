"""Request ids: short, unique, cheap (no uuid4 per request)."""

from __future__ import annotations

import itertools
import os
import random


class IdGenerator:
    """`<prefix><random run id><counter>`: unique within a run, unlikely to collide across runs."""

    __slots__ = ("_counter", "_prefix")

    def __init__(self, prefix: str = "gw-") -> None:
        self._prefix = f"{prefix}{os.urandom(4).hex()}-"
        self._counter = itertools.count(1)

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


def new_room(rng: random.Random) -> int:
    """A SGLang bootstrap room: uniform in [0, 2**63 - 1], like the engine's own routers."""
    return rng.getrandbits(63)
