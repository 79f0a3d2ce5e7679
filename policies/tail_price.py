"""`cache_aware`'s tail price (`tail_price`, `tail_ttft_s`; `tail_price = 0`, the default: off).

The cost `cache_aware` minimises (policies/cache_aware.py) is the request's predicted TTFT plus
what its prefill costs the others (the batch term, the busy-pool externality `K x work`, the
eviction price): a mean's objective, linear in the request's own wait. Under load the
externality of recomputing a prefix is large (`K` grows with the pool's mean wait and its
busy-period factor), so a cached turn stays on its holder however long the holder's queue is,
although another worker is predicted to answer it far sooner and the decode SLOs allow the move.
Each such turn waits beyond the TTFT the pool's p90 is made of. The tail price makes the
request's own latency convex beyond a threshold:

    tail(w) = tail_price x max(0, ttft(w) - tail_ttft_s)       (seconds, added to cost(w))

`ttft(w)` is the predicted TTFT (queue + own prefill). Below `tail_ttft_s` nothing changes: a
short wait keeps the cache affinity. Beyond it every predicted second counts `1 + tail_price`
times, so a turn leaves a badly backed-up holder for a worker predicted within. A prompt whose
own prefill is over the threshold anywhere pays on every worker: the difference between the
workers' predicted TTFTs counts `1 + tail_price` times, the rest is the same for all. The price
is part of the cost, which the SLO rule (policies/decode_slo.py) orders after the fewest decodes
broken: a move never breaks more decodes.
"""

from __future__ import annotations


def tail_s(ttft_s: float, price: float, threshold_s: float) -> float:
    """The tail price of a candidate predicted at `ttft_s` (0 at or below `threshold_s`)."""
    over = ttft_s - threshold_s
    return price * over if over > 0.0 else 0.0
