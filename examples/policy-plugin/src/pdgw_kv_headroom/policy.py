"""`kv-headroom`: score workers by the KV cache they have free, next to their load.

A worker whose KV cache is nearly full will preempt or queue new requests (vLLM's and SGLang's
schedulers admit a request only when its blocks fit), so this scorer prefers headroom:
`score = 1 - kv_usage` (the engine-reported usage, 0..1). It is combined, weighted, with the
built-in `LoadScorer` (requests and tokens in flight, engine queues), and the highest total wins.

Options (the TOML `options` table), checked strictly:
  kv_weight    weight of the headroom score (default 1.0)
  load_weight  weight of the load score (default 1.0)
  decider      the `[decider]` of the policy as a table (default: always disaggregate)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from policies.base import Profile
from policies.build import build_decider
from policies.config import DeciderCfg
from policies.least_load import LoadScorer, MaxScorePicker
from policies.pd import PDPolicy
from policies.snapshot import RequestView, WorkerState


class Options(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    kv_weight: float = 1.0
    load_weight: float = 1.0
    decider: DeciderCfg = DeciderCfg()

    def __post_init__(self) -> None:
        if self.kv_weight < 0 or self.load_weight < 0 or self.kv_weight + self.load_weight == 0:
            raise ValueError("kv_weight and load_weight must be >= 0, not both 0")


class KvHeadroomScorer:
    name = "kv_headroom"

    def score(self, req: RequestView, cands: Sequence[WorkerState]) -> Mapping[str, float]:
        return {w.id: min(1.0, max(0.0, 1.0 - w.load.kv_usage)) for w in cands}


def profile(opts: Options, role: str) -> Profile:
    return Profile(
        name=f"kv-headroom/{role}",
        picker=MaxScorePicker(),
        scorers=((KvHeadroomScorer(), opts.kv_weight), (LoadScorer(), opts.load_weight)),
    )


def factory(options: dict[str, object]) -> PDPolicy:
    """The entry point: the policy from the `options` table (errors name the bad option)."""
    opts = msgspec.convert(options, Options)
    return PDPolicy(
        "kv-headroom",
        decode=profile(opts, "decode"),
        prefill=profile(opts, "prefill"),
        colocated=profile(opts, "colocated"),
        decider=build_decider(opts.decider),
    )
