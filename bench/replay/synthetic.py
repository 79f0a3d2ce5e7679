"""Synthetic workloads, as trace rows (so that every input goes through the same replay).

Block ids encode what is shared: a system prompt, a document, a session's history. Each
generator is seeded and deterministic. Lengths are in tokens; arrivals are Poisson unless the
workload is `bursty`.

  * `chat`: one shared system prompt, a user turn of its own, short answers;
  * `rag`: a system prompt, one of `docs` documents (Zipf popularity), a question of its own;
  * `mixed`: chat and rag requests interleaved (half each);
  * `bursty`: chat requests arriving in bursts (on/off: `burst` requests at once, then a pause);
  * `multiturn`: sessions of several turns; turn k's prompt is turn k-1's prompt plus its
    answer plus a new user message, so a session's turns share a growing prefix, and each row
    carries the session's id.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from bench.replay.trace import BLOCK_TOKENS, Row, blocks_needed

KINDS = ("chat", "rag", "mixed", "bursty", "multiturn")


@dataclass(frozen=True)
class SynthSpec:
    kind: str
    requests: int = 200
    rate: float = 2.0  # requests per second on average
    seed: int = 0
    system_tokens: int = 1024
    user_tokens: int = 512  # mean of a lognormal
    output_tokens: int = 128  # mean of a lognormal
    doc_tokens: int = 8192
    docs: int = 16
    burst: int = 8
    turns: int = 4
    think_s: float = 5.0  # mean pause between a session's turns


class _Ids:
    """Fresh block ids; a named span (system prompt, document, session) keeps its ids."""

    def __init__(self) -> None:
        self.next = 0
        self.named: dict[str, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out

    def span(self, name: str, n_blocks: int) -> list[int]:
        ids = self.named.setdefault(name, [])
        if len(ids) < n_blocks:
            ids.extend(self.fresh(n_blocks - len(ids)))
        return ids[:n_blocks]


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.6, lo: int = 1) -> int:
    mu = math.log(max(mean, 1.0)) - sigma * sigma / 2.0
    return max(lo, round(rng.lognormvariate(mu, sigma)))


def _row(t: float, ids: _Ids, shared: list[int], shared_tokens: int, own: int, out: int) -> Row:
    """A prompt of `shared_tokens` (whole blocks `shared`) then `own` tokens of its own."""
    total = shared_tokens + own
    n = blocks_needed(total)
    return Row(t, total, out, tuple(shared + ids.fresh(n - len(shared))))


def _aligned(tokens: int) -> int:
    return max(BLOCK_TOKENS, tokens // BLOCK_TOKENS * BLOCK_TOKENS)


def generate(spec: SynthSpec) -> list[Row]:
    if spec.kind not in KINDS:
        raise ValueError(f"unknown synthetic workload {spec.kind!r}; known: {', '.join(KINDS)}")
    rng = random.Random(spec.seed)
    ids = _Ids()
    sys_tok = _aligned(spec.system_tokens)
    doc_tok = _aligned(spec.doc_tokens)
    zipf = [1.0 / (k + 1) for k in range(spec.docs)]

    def chat(t: float) -> Row:
        system = ids.span("system", sys_tok // BLOCK_TOKENS)
        return _row(t, ids, system, sys_tok, _lognormal(rng, spec.user_tokens), _out())

    def rag(t: float) -> Row:
        doc = rng.choices(range(spec.docs), weights=zipf)[0]
        system = ids.span("system", sys_tok // BLOCK_TOKENS)
        body = ids.span(f"doc{doc}", doc_tok // BLOCK_TOKENS)
        return _row(t, ids, system + body, sys_tok + doc_tok, _lognormal(rng, 128), _out())

    def _out() -> int:
        return _lognormal(rng, spec.output_tokens)

    if spec.kind == "multiturn":
        return _multiturn(spec, rng, ids, sys_tok)
    make: Callable[[float], Row]
    if spec.kind == "rag":
        make = rag
    elif spec.kind == "mixed":

        def make(t: float) -> Row:
            return chat(t) if rng.random() < 0.5 else rag(t)
    else:
        make = chat
    rows: list[Row] = []
    t = 0.0
    for i in range(spec.requests):
        if spec.kind == "bursty":
            if i and i % spec.burst == 0:
                t += rng.expovariate(spec.rate / spec.burst)
        elif i:
            t += rng.expovariate(spec.rate)
        rows.append(make(t))
    return rows


def _multiturn(spec: SynthSpec, rng: random.Random, ids: _Ids, sys_tok: int) -> list[Row]:
    sessions = max(1, math.ceil(spec.requests / spec.turns))
    rows: list[Row] = []
    start = 0.0
    for s in range(sessions):
        if s:
            start += rng.expovariate(spec.rate / spec.turns)
        # the session's history is one stream of tokens: the shared system prompt, then its
        # own blocks; turn k reads its first `length` tokens (the last block partly)
        system = ids.span("system", sys_tok // BLOCK_TOKENS)
        length = sys_tok + _lognormal(rng, spec.user_tokens)
        t = start
        for _k in range(spec.turns):
            if len(rows) >= spec.requests:
                break
            out = _lognormal(rng, spec.output_tokens)
            n = blocks_needed(length)
            own = ids.span(f"session{s}", n - len(system))
            rows.append(Row(t, length, out, tuple(system + own), f"session-{s}"))
            length += out + _lognormal(rng, spec.user_tokens)
            t += out * 0.02 + rng.expovariate(1.0 / spec.think_s)
    rows.sort(key=lambda r: r.t_s)
    return rows
