"""Batches and `n > 1` through the gateway, against the real engines: every element of the
answer has the single server's tokens. For SGLang this checks the room scheme on the wire (a
scalar `bootstrap_room` that the engines read as room + i for element i): a wrong room leaves
the decode waiting for KV that never comes. For vLLM, whose prefill answer carries one
`kv_transfer_params` object, the decode serves these requests alone (`decode_self_prefill`)."""

from __future__ import annotations

import random
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.e2e._support import Lane, _text, metric, scrape, unique_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_TOKENS = 12


def _texts(client: OpenAI, kind: str, stream: bool, **kw: Any) -> dict[int, tuple[str, str | None]]:
    """(text, finish_reason) per choice index."""
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0.0} | kw
    api: Any = client.chat.completions.create if kind == "chat" else client.completions.create
    out: dict[int, tuple[str, str | None]] = {}
    if not stream:
        r = api(**kw)
        for c in r.choices:
            out[c.index] = ((c.message.content or "") if kind == "chat" else c.text, c.finish_reason)
        return out
    parts: dict[int, list[str]] = {}
    finish: dict[int, str | None] = {}
    with api(stream=True, **kw) as s:
        for chunk in s:
            for c in chunk.choices:
                piece = (c.delta.content if kind == "chat" else c.text) or ""
                parts.setdefault(c.index, []).append(piece)
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
    return {i: ("".join(p), finish.get(i)) for i, p in parts.items()}


def _kv_sent(lane: Lane) -> float:
    """SGLang: KV shipments the prefill has made (one per sequence it prefilled for a decode)."""
    return metric(scrape(lane.prefill), "sglang:kv_transfer_total_mb_count")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_batch_of_prompts_equals_single_server(
    lane: Lane, gateway: OpenAI, reference: OpenAI, stream: bool
) -> None:
    # three prompts of different lengths, none seen before (no prefix-cache help on either side)
    prompts = [unique_prompt(n, f"batch-{stream}-{n}") for n in (3, 40, 110)]
    sent = _kv_sent(lane) if lane.engine == "sglang" else 0.0
    got = _texts(gateway, "completions", stream, model=lane.model, prompt=prompts)
    want = _texts(reference, "completions", stream, model=lane.model, prompt=prompts)
    assert sorted(got) == [0, 1, 2], got
    assert got == want
    if lane.engine == "sglang":
        # each element's KV went from the prefill to the decode (a room per element)
        assert _kv_sent(lane) - sent >= len(prompts)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_n_2_equals_single_server(
    lane: Lane, gateway: OpenAI, reference: OpenAI, kind: str, stream: bool
) -> None:
    prompt = _text(random.Random(f"n2-{kind}-{stream}"), 30)
    kw: dict[str, Any] = {"model": lane.model, "n": 2}
    if kind == "chat":
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    if lane.engine == "vllm":
        # vLLM refuses n > 1 with greedy sampling; the gateway passes its 400 on as it is
        with pytest.raises(openai.BadRequestError) as ei:
            _texts(gateway, kind, stream, **kw)
        assert "n must be 1 when using greedy sampling" in str(ei.value)
        # seeded sampling: the decode serves n > 1 alone, sample for sample the single server's
        kw |= {"temperature": 0.8, "seed": 1234}
        got = _texts(gateway, kind, stream, **kw)
        want = _texts(reference, kind, stream, **kw)
        assert sorted(got) == [0, 1] and got == want, (got, want)
        return
    got = _texts(gateway, kind, stream, **kw)
    want = _texts(reference, kind, stream, **kw)
    assert sorted(got) == [0, 1], got
    assert got == want
    assert got[0] == got[1]  # greedy: both samples are the same
