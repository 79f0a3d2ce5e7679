"""The timing model: pure functions of a :class:`~emulator.profiles.Profile` (seconds, unscaled).

* Prefill is compute-bound: ``2 x params x new_tokens`` (the dense matmuls) plus attention
  ``4 x layers x hidden x new_tokens x (cached_tokens + new_tokens / 2)`` (QK^T and AV over the
  causal context), over ``TFLOP/s x efficiency``. Cached prefix tokens cost nothing but the
  attention they are read by.
* A decode step is bandwidth-bound: ``(weight bytes + KV bytes read by the batch)`` over
  ``HBM bandwidth x efficiency`` - the weights are read once per step for the whole batch, each
  running sequence's KV cache is read once.
* A mixed step (chunked prefill + decode on a colocated worker) costs the larger of its compute
  time and its memory time, so a prefill chunk visibly slows the decodes batched with it.
* A KV transfer costs ``bytes / (link bandwidth x efficiency)``.
"""

from __future__ import annotations

from emulator.profiles import Profile


def prefill_flops(p: Profile, new_tokens: int, cached_tokens: int = 0) -> float:
    if new_tokens <= 0:
        return 0.0
    m = p.model
    dense = 2.0 * m.params * new_tokens
    attention = 4.0 * m.layers * m.hidden * new_tokens * (cached_tokens + new_tokens / 2.0)
    return dense + attention


def prefill_time(p: Profile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Seconds to prefill ``new_tokens`` after ``cached_tokens`` of reused prefix."""
    if new_tokens <= 0:
        return 0.0
    return p.step_overhead_s + prefill_flops(p, new_tokens, cached_tokens) / p.flops


def decode_step_time(p: Profile, batch_size: int, batch_kv_tokens: int) -> float:
    """Seconds for one decode step of ``batch_size`` sequences holding ``batch_kv_tokens`` in total."""
    if batch_size <= 0:
        return 0.0
    m = p.model
    memory = (m.weight_bytes + m.kv_bytes_per_token * batch_kv_tokens) / p.bandwidth
    compute = 2.0 * m.params * batch_size / p.flops
    return p.step_overhead_s + max(memory, compute)


def mixed_step_time(
    p: Profile, prefill_chunks: list[tuple[int, int]], batch_size: int, batch_kv_tokens: int
) -> float:
    """One engine step: prefill chunks ``(new, cached)`` plus a decode batch, sharing the GPU."""
    flops = sum(prefill_flops(p, new, cached) for new, cached in prefill_chunks)
    flops += 2.0 * p.model.params * batch_size
    kv_read = batch_kv_tokens + sum(new + cached for new, cached in prefill_chunks)
    memory = (p.model.weight_bytes + p.model.kv_bytes_per_token * kv_read) / p.bandwidth
    if flops == 0.0 and batch_size == 0:
        return 0.0
    return p.step_overhead_s + max(flops / p.flops, memory)


def transfer_time(p: Profile, num_tokens: int) -> float:
    """Seconds to move the KV of ``num_tokens`` prompt tokens between prefill and decode."""
    return num_tokens * p.model.kv_bytes_per_token / p.link_bandwidth
