"""The decode-consistency guard of one handoff (docs/guards.md, guard 3): what the decode's answer
must agree with, and what happens when it does not.

A `DecodeCheck` is built from the prefill's answer, read by its adapter
(`shadow.decode_check`, which also starts a verification run where one is due); the relay
(gateway/orchestration/relay.py) asks it on the decode's first token and on its end, and a
failed check becomes a `KVIntegrityError` here (`integrity`), the pair suspect from then on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from adapters import EngineAdapter, HandoffCtx
from common.errors import KVIntegrityError
from common.request import ParsedRequest
from common.summary import Summary
from gateway.guards import Guard, check_decode
from gateway.orchestration.services import Services
from gateway.registry import Worker
from policies.snapshot import RequestView


class DecodeCheck(msgspec.Struct, eq=False):
    """Decode-consistency checks of one handoff, against what its prefill said."""

    ctx: HandoffCtx
    adapter: EngineAdapter
    req: ParsedRequest
    prefill: Summary
    context_length: int | None = None  # the decode's
    # the registry's `suspect_epoch` when the handoff started: another one at its end means a
    # pair became suspect meanwhile, maybe this one (`shadow.verify_late`)
    epoch: int = 0
    # a colocated re-run whose answer must agree before this one is delivered, or None
    verify: asyncio.Future[bytes | None] | None = None
    # the request as routing saw it: what a re-run is booked with on the worker it runs on
    view: RequestView | None = None
    # told once when the decode's first token is a near tie of the prefill's, not its own
    on_tie: Callable[[DecodeCheck, Summary], None] | None = None
    tied: bool = False

    def drop_verification(self) -> None:
        """The attempt ended without consuming its verification run: stop it."""
        if self.verify is not None:
            self.verify.cancel()
            self.verify = None

    def summarize(self, payloads: list[bytes]) -> Summary:
        return self.adapter.summarize(self.req, payloads)

    def check_first(self, first: Summary) -> str | None:
        """On the first token: its identity (greedy or seeded) and the prompt size, when the event
        says it."""
        early = Summary(
            prompt_tokens=first.prompt_tokens,
            first_token_id=first.first_token_id,
            first_text=first.first_text,
            parsed=first.parsed,
        )
        why = check_decode(
            self.prefill, early, max_tokens=None, context_length=None, greedy=self.req.same_first_token
        )
        if early.tied:
            self._tie(early)
        return why

    def check_end(self, whole: Summary) -> str | None:
        why = check_decode(
            self.prefill,
            whole,
            max_tokens=self.req.max_tokens,
            context_length=self.context_length,
            greedy=self.req.same_first_token,
        )
        if whole.tied:
            self._tie(whole)
        return why

    def _tie(self, decode: Summary) -> None:
        if not self.tied:
            self.tied = True
            if self.on_tie is not None:
                self.on_tie(self, decode)


def integrity(
    s: Services, c: DecodeCheck, why: str, w: Worker, stage: str, guard: Guard = Guard.DECODE_CONSISTENCY
) -> KVIntegrityError:
    """A handoff's answer failed a check: counted, and the pair is suspect from now on (its
    next answers are verified before delivery). Not for an answer that went on from the
    prefill's near-tied runner-up and then differed from its re-run (which takes the prefill's
    own token): numerics can do that to a sound answer, so it is served again elsewhere, but
    the pair is not suspected for it (that would have every answer of a pair whose first tokens
    tie now and then verified)."""
    if not (c.tied and guard is Guard.SHADOW):
        s.registry.mark_suspect(f"{c.ctx.prefill.id}|{c.ctx.decode.id}", s.cfg.guards.suspect_window_s)
    s.guard_failed(
        guard,
        stage,
        c.ctx.request_id,
        why,
        prefill=c.ctx.prefill.id,
        decode=c.ctx.decode.id,
    )
    return KVIntegrityError(f"KV integrity check failed: {why}", phase="decode", worker=w.id)
