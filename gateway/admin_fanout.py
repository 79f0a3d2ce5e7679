"""An admin request passed on to the gateway's other processes (`serve --workers N`), and their
answers put together: how many hold a change, and the admission counters added up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from gateway.http.server import HttpRequest
from gateway.logging import get_logger

if TYPE_CHECKING:
    from gateway.multiprocess.siblings import SiblingAnswer, Siblings

log = get_logger("pd_gateway.admin")


async def _pass_on(
    fan: Siblings, req: HttpRequest, target: str, *, timeout_s: float = 60.0
) -> list[SiblingAnswer]:
    """The admin request, as received (its token included), to every other process."""
    headers = [(b"authorization", req.header(b"authorization") or b"")]
    if req.body:
        headers.append((b"content-type", b"application/json"))
    return await fan.ask(req.method, target, body=req.body, headers=headers, timeout_s=timeout_s)


def _applied(answers: list[SiblingAnswer], fan: Siblings, *, ok: tuple[int, ...]) -> dict[str, Any]:
    """How many processes hold the change (this one did), and what the others said if not."""
    failed = [
        {
            "process": a.process,
            "status": a.status,
            "error": a.error or a.body.decode("utf-8", "replace")[:300],
        }
        for a in answers
        if a.status not in ok
    ]
    if failed:
        log.error("admin.not_applied_everywhere", failed=failed)
    return {"count": fan.ctx.count, "applied": 1 + len(answers) - len(failed), "failed": failed}


_ADMISSION_SUMS = (
    "active",
    "active_tokens",
    "queued",
    "clients",
    "admitted",
    "admitted_after_queue",
    "queue_wait_s",
    "max_concurrent",
    "max_queue",
)


def _add_admission(own: dict[str, Any], answers: list[SiblingAnswer], fan: Siblings) -> dict[str, Any]:
    """Every process's admission counters added up (each holds its share of the limits)."""
    out = dict(own)
    out["shed"] = dict(own.get("shed", {}))
    answered = 1
    for a in answers:
        if a.status != 200:
            continue
        answered += 1
        other = msgspec.json.decode(a.body)
        for k in _ADMISSION_SUMS:
            out[k] = out.get(k, 0) + other.get(k, 0)
        if out.get("max_inflight_tokens") is not None and other.get("max_inflight_tokens") is not None:
            out["max_inflight_tokens"] += other["max_inflight_tokens"]
        for reason, n in other.get("shed", {}).items():
            out["shed"][reason] = out["shed"].get(reason, 0) + n
    out["processes"] = {"count": fan.ctx.count, "answered": answered}
    return out
