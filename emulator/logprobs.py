"""OpenAI-route logprobs of the emulated model (`logprobs` on completions, `logprobs` +
`top_logprobs` on chat), in the shapes both engines answer with.

A token's logprob is a function of the token before it and itself (`model.prompt_logprob`), so
a P/D answer and a colocated one with the same tokens carry the same logprobs, and different
tokens (a wrong KV) show in them too. The chosen token is always the most likely; the other
`top` entries are the next letters of the model's alphabet, each less likely than the last.
"""

from __future__ import annotations

from typing import Any

import msgspec

from emulator import model, tokenizer

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


class LogprobAsk(msgspec.Struct, frozen=True):
    chat: bool
    top: int  # alternatives asked for (completions: `logprobs`; chat: `top_logprobs`)


def logprob_ask(body: dict[str, Any], chat: bool, max_logprobs: int = MAX_LOGPROBS) -> LogprobAsk | None:
    """What the request asks for, or None. Raises ValueError for a value the engines refuse
    (`max_logprobs`: vLLM's --max-logprobs, -1 no cap)."""
    if chat:
        if not body.get("logprobs"):
            if body.get("top_logprobs"):
                raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
            return None
        top = body.get("top_logprobs") or 0
    else:
        top = body.get("logprobs")
        if top is None or top is False:
            return None
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"logprobs must be a non-negative integer, got {top!r}")
    if max_logprobs >= 0 and top > max_logprobs:
        raise ValueError(
            f"Requested sample logprobs of {top}, which is greater than max allowed: {max_logprobs}"
        )
    return LogprobAsk(chat, top)


def alternatives(prev: int, tok: int, top: int) -> list[tuple[int, float]]:
    """The `top` most likely tokens after `prev` where `tok` came, best first (`tok` itself)."""
    lp = model.prompt_logprob(prev, tok)
    out = [(tok, lp)]
    gap = model.tie_gap(prev, tok)
    first = 0.25 if gap is None else gap  # the runner-up's distance (a near tie: small)
    for alt in model.ALPHABET_IDS:
        if len(out) >= top:
            break
        if all(alt != t for t, _ in out):
            out.append((alt, lp - first - 0.25 * (len(out) - 1)))
    return out[:top]


def logprobs(ask: LogprobAsk, tokens: list[int], prev: int, offset: int = 0) -> dict[str, Any]:
    """The `logprobs` object of a choice (or of one stream chunk) for `tokens`, `prev` being the
    token before the first of them (the prompt's last, or the previous chunk's last) and `offset`
    the length of the text before them (completions' `text_offset`)."""
    if ask.chat:
        content = []
        for tok in tokens:
            text = tokenizer.token_text(tok)
            alts = alternatives(prev, tok, ask.top)
            content.append(
                {
                    "token": text,
                    "logprob": model.prompt_logprob(prev, tok),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": tokenizer.token_text(t),
                            "logprob": lp,
                            "bytes": list(tokenizer.token_text(t).encode()),
                        }
                        for t, lp in alts
                    ],
                }
            )
            prev = tok
        return {"content": content}
    texts, lps, tops, offsets = [], [], [], []
    for tok in tokens:
        text = tokenizer.token_text(tok)
        texts.append(text)
        lps.append(model.prompt_logprob(prev, tok))
        tops.append({tokenizer.token_text(t): lp for t, lp in alternatives(prev, tok, max(1, ask.top))})
        offsets.append(offset)
        offset += len(text)
        prev = tok
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": texts, "top_logprobs": tops}


def sglang_offsets(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """A completions `logprobs` object as SGLang answers it: `text_offset` is -1 for every token,
    the echoed prompt's too (`to_openai_style_logprobs` appends -1, "Not supported yet":
    entrypoints/openai/utils.py:150-151). Chat `logprobs` (no `text_offset`) pass unchanged."""
    if lp is None or "text_offset" not in lp:
        return lp
    return {**lp, "text_offset": [-1] * len(lp["text_offset"])}
