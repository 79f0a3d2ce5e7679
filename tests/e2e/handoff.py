"""One vLLM P/D handoff sent straight to the lane's prefill and decode, with the bodies the
gateway builds (adapters/vllm.py: the prefill asked for its near-tie logprobs and one token, the
decode handed the prefill's `kv_transfer_params`). Used by the tests that look at a handoff's
parts (test_edges.py) and, as a script, by tests/e2e/lane.sh to warm the P/D path before the tests:

    python -m tests.e2e.handoff PREFILL_URL DECODE_URL MODEL [TIMEOUT_S]

Why the lane warms it: the lane's first P/D request pays one-off set-up in both engines on the
CPU that plain requests do not reach: vLLM compiles its logprobs rank kernel with torch.compile
on the first request that asks for logprobs (the gateway asks every greedy prefill for its
near-tie alternatives; measured 70.1 s on a busy 2-core machine), and the decode makes its first
NIXL handshake with the prefill and its first KV pull. That took the lane's first P/D request,
`test_edges.py::test_one_token_answers[chat-whole]`, past the tests' 60 s client timeout, and
can exceed the gateway's own 60 s prefill deadline. Here each leg has a generous deadline and is
timed, and a failure ends the lane with a message naming the leg, so a real hang is not hidden.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import msgspec

from adapters import ADAPTERS, HandoffCtx, PrefillVerdict
from common.request import parse_request
from common.workers import Engine, Role, RouteKind, WorkerState

# chat first: the lane's first P/D request was a chat (its one-off costs are measured on it)
KIND_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class Handoff:
    verdict: PrefillVerdict  # the adapter's reading of the prefill's answer
    answer: dict[str, Any]  # the decode's
    prefill_s: float
    decode_s: float


class LegFailed(Exception):
    pass


def vllm_handoff(
    prefill: str, decode: str, model: str, kind: str, prompt: str, max_tokens: int, timeout: float = 600.0
) -> Handoff:
    """Prefill then decode of one greedy request, as the gateway would send them (its near-tie
    ask of 3 alternatives included). Raises LegFailed naming the leg that failed."""
    path = KIND_PATHS[kind]
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    route = RouteKind.CHAT if kind == "chat" else RouteKind.COMPLETIONS
    req = parse_request(
        route, path, json.dumps(body).encode(), default_model=model, max_n=8, max_tokens_cap=None
    )
    rid = f"handoff-{kind}-{random.randrange(1 << 30)}"
    p = WorkerState(id="p", url=prefill, role=Role.PREFILL, engine=Engine.VLLM)
    d = WorkerState(id="d", url=decode, role=Role.DECODE, engine=Engine.VLLM)
    ctx = HandoffCtx(request_id=rid, prefill=p, decode=d, room=0, near_ties=3, near_tie_margin=1e9)
    vllm = ADAPTERS[Engine.VLLM]

    def send(leg: str, base: str, data: bytes) -> tuple[bytes, float]:
        r = urllib.request.Request(
            base + path, data, {"content-type": "application/json", "X-Request-Id": rid}
        )
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(r, timeout=timeout) as resp:  # only the lane's 127.0.0.1 servers
                out: bytes = resp.read()
        except OSError as e:  # HTTPError and timeouts included
            took = time.monotonic() - t0
            raise LegFailed(
                f"the {kind} {leg} at {base} failed after {took:.1f}s (deadline {timeout:g}s): {e}"
            ) from e
        return out, time.monotonic() - t0

    out, prefill_s = send("prefill", prefill, vllm.prefill_body(req, ctx))
    verdict = vllm.judge_prefill(req, ctx, 200, out)
    if not verdict.ok:
        raise LegFailed(f"the {kind} prefill's answer is no handoff: {verdict.reason}: {out[:300]!r}")
    data, decode_s = send("decode", decode, vllm.decode_body(req, ctx, verdict))
    return Handoff(verdict, msgspec.json.decode(data), prefill_s, decode_s)


def main(argv: list[str]) -> int:
    prefill, decode, model = argv[:3]
    timeout = float(argv[3]) if len(argv) > 3 else 600.0
    for kind in KIND_PATHS:
        try:
            h = vllm_handoff(prefill, decode, model, kind, f"warm up the {kind} handoff", 2, timeout)
        except LegFailed as e:
            print(f"P/D warm-up: {e}", file=sys.stderr)
            return 1
        print(f"P/D warm-up, {kind}: prefill {h.prefill_s:.1f}s, decode {h.decode_s:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
