"""Request ids (rids) as SGLang's tokenizer manager and scheduler treat them: a rid is held by
its request from intake to the end of its answer (the tokenizer manager's ``rid_to_state``), a
second request naming a held rid is refused, and an abort names a held rid and reaches every
request whose rid *starts with* it."""

from __future__ import annotations

import asyncio
from collections import Counter

from emulator.scheduler import Engine, Seq
from emulator.sglang.items import Item


class RidTable:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.seqs: dict[str, Seq] = {}  # the sequences running, by rid
        # the rids requests hold, from their intake to the end of their answer (the tokenizer
        # manager's rid_to_state): a second request naming one is refused, an abort must name one
        self.held: set[str] = set()

    def hold(self, items: list[Item], held: list[str]) -> str | None:
        """Take the items' rids for this request (into `held`, released when its answer ends),
        or SGLang's refusal: rids repeated within the request (``_validate_rid_uniqueness``,
        io_struct.py:390-397), then a rid another request in flight holds
        (``_init_req_state``, tokenizer_manager.py:3832-3836). Both are ValueErrors inside
        ``generate_request``, before the length and sampling checks."""
        rids = [it.rid for it in items]
        if len(set(rids)) != len(rids):
            counts = Counter(rids)
            return f"Duplicate request IDs detected within the request: {[r for r, c in counts.items() if c > 1]}"
        for rid in rids:
            if rid in self.held:
                return f"Duplicate request ID detected: {rid}"
        self.held.update(rids)
        held.extend(rids)
        return None

    def release(self, held: list[str]) -> None:
        self.held.difference_update(held)

    def abort(self, rid: str, spare: frozenset[str] = frozenset()) -> bool:
        """SGLang's ``abort_request(rid)``: ignored unless a request in flight holds exactly that
        rid (tokenizer_manager.py:2241-2253); then the scheduler aborts every request whose rid
        *starts with* it (scheduler.py:5677, 5688 and its P/D queues: ``startswith``)."""
        if not rid or rid not in self.held:
            return False
        hit = False
        for name, seq in list(self.seqs.items()):
            if name.startswith(rid) and name not in spare:
                self.engine.abort_seq(seq)
                hit = True
        return hit

    def abort_all(self) -> None:
        for seq in list(self.seqs.values()):
            self.engine.abort_seq(seq)

    def client_gone(self, held: list[str]) -> None:
        """A request's client went away: SGLang aborts each of its rids
        (``_release_req_states_on_failure``, tokenizer_manager.py:3850-3866), by prefix, so
        others' requests whose rids extend one of them go too. (Its own are being cancelled.)"""
        spare = frozenset(held)
        for rid in held:
            self.abort(rid, spare)

    def abort_later(self, rids: list[str]) -> None:
        """A streamed ``/generate`` answer's background task: 2 s after the answer, each of its
        rids that a request still holds is aborted (``create_abort_task``,
        tokenizer_manager.py:2427-2438; http_server.py:977-981) -- a later request that reuses
        the rid, or the one whose rid a refused duplicate named."""
        if rids:
            asyncio.get_running_loop().call_later(2.0, self._abort_each, tuple(rids))

    def _abort_each(self, rids: tuple[str, ...]) -> None:
        for rid in rids:
            self.abort(rid)

    def cached_tokens(self, rid: str) -> int:
        """The prompt tokens the running request `rid` found cached (0 when it is not running)."""
        seq = self.seqs.get(rid)
        return seq.cached_tokens if seq is not None else 0
