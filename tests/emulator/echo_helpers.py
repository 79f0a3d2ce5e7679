"""Reading completions answers (whole or streamed) choice by choice, for the echo tests."""

from __future__ import annotations

import itertools
import json
from typing import Any

from emulator import model, tokenizer
from tests.emulator.conftest import sse_events

LP_KEYS = ("text_offset", "token_logprobs", "tokens", "top_logprobs")


def choices(raw: str, stream: bool) -> dict[int, dict[str, Any]]:
    """Each choice's text, logprobs (a stream's chunks joined), finish and first chunk's text."""
    if not stream:
        return {c["index"]: {**c, "first": c["text"]} for c in json.loads(raw)["choices"]}
    out: dict[int, dict[str, Any]] = {}
    for e in sse_events(raw):
        if e == "[DONE]":
            continue
        for c in json.loads(e)["choices"]:
            acc = out.setdefault(
                c["index"], {"text": "", "logprobs": None, "finish_reason": None, "first": c["text"]}
            )
            acc["text"] += c["text"]
            if c.get("logprobs") is not None:
                lp = acc["logprobs"] or {k: [] for k in LP_KEYS}
                acc["logprobs"] = {k: lp[k] + c["logprobs"][k] for k in LP_KEYS}
            acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
    return out


def prompt_scores(prompt: list[int]) -> list[float | None]:
    """The logprobs the emulated model gives a prompt's tokens (the first has none)."""
    return [None] + [model.prompt_logprob(a, b) for a, b in itertools.pairwise(prompt)]


def check_offsets(lp: dict[str, Any]) -> None:
    """`text_offset` counts from the echoed text's start, token after token."""
    assert lp["text_offset"][0] == 0
    for i in range(1, len(lp["tokens"])):
        assert lp["text_offset"][i] == lp["text_offset"][i - 1] + len(lp["tokens"][i - 1])


def shifted(lp: dict[str, Any], by: int) -> dict[str, Any]:
    return {**lp, "text_offset": [o + by for o in lp["text_offset"]]}


def encode(text: str) -> list[int]:
    return tokenizer.encode(text)


def completion_body(stream: bool = False, **extra: Any) -> dict[str, Any]:
    """A greedy 6-token /v1/completions body; `extra` (the `prompt` too) on top."""
    return {"model": "m", "max_tokens": 6, "temperature": 0, "stream": stream} | extra
