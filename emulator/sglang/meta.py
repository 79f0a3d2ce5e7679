"""`/generate`'s answer objects: text, output ids and SGLang 0.5.23's `meta_info` (with the
logprobs SGLang merges across P/D: a decode has no input logprobs)."""

from __future__ import annotations

import time
from typing import Any

from emulator import model, tokenizer
from emulator.sglang.items import Item, Result


def meta_info(role: str, item: Item, res: Result, final: bool, n_out: int) -> dict[str, Any]:
    """`meta_info` of a `/generate` answer or event, as SGLang 0.5.23 fills it for `role`."""
    now = time.time()
    cached = res.cached_tokens
    m: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": res.finish if final else None,
        "prompt_tokens": res.prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
    }
    if role != "decode":
        m["storage_prefetch_wait"] = 0.0
        m["storage_staging_wait"] = 0.0
    m["forward_entry_time"] = res.t_received
    if role != "decode":
        m["prefill_finished_time"] = res.t_first or now
    m["queue_time"] = 0.0
    if item.logprob:
        lp = _logprobs(role, item, res, n_out)
        m.update(lp)
    m["reasoning_tokens"] = 0
    m["completion_tokens"] = n_out
    m["cached_tokens"] = cached
    if final:
        m["weight_versions"] = [{"version": "default", "start": 0, "end": n_out}]
    m["cached_tokens_details"] = {"device": cached, "host": 0} if cached else None
    m["dp_rank"] = None
    if final:
        e2e = now - res.t_received
        m["e2e_latency"] = e2e
        m["request_received_ts"] = res.t_received
        m["first_token_latency"] = (res.t_first or now) - res.t_received
        m["api_server_dispatch_finish_ts"] = res.t_received
        m["request_finished_ts"] = now
        if n_out > 1:
            m["decode_throughput"] = n_out / max(e2e, 1e-9)
    m["response_sent_to_client_ts"] = now
    return m


def _logprobs(role: str, item: Item, res: Result, n_out: int) -> dict[str, Any]:
    prompt = item.prompt
    if role == "decode":
        inp: list[list[Any]] = []
    else:
        inp = [[None, prompt[0], None]] + [
            [model.prompt_logprob(prompt[i - 1], prompt[i]), prompt[i], None] for i in range(1, len(prompt))
        ]
    outs = res.output_ids[:n_out]
    out_lp: list[list[Any]] = [[model.prompt_logprob(i, t), t, None] for i, t in enumerate(outs)]
    d: dict[str, Any] = {
        "input_token_logprobs": inp,
        "output_token_logprobs": out_lp,
        "output_token_logprobs_length": len(out_lp),
    }
    if item.top_n > 0:
        d["input_top_logprobs"] = [] if not inp else [[e] for e in inp]
        d["output_top_logprobs"] = [
            [e]
            + [
                [float(e[0]) - 0.05 * (k + 1), (int(e[1]) + k + 1) % tokenizer.VOCAB_SIZE, None]
                for k in range(item.top_n - 1)
            ]
            for e in out_lp
        ]
    return d


def generate_obj(role: str, item: Item, res: Result, final: bool) -> dict[str, Any]:
    """A `/generate` answer (or stream event) for `item`."""
    n = len(res.output_ids)
    return {
        "text": res.text,
        "output_ids": list(res.output_ids),
        "meta_info": meta_info(role, item, res, final, n),
    }
