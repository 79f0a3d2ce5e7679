"""Stop strings and stop token ids of the emulated model.

Both engines end a sequence at the first occurrence of a `stop` string in its text, or at a
token of `stop_token_ids`, with finish reason "stop" (vLLM names the match in `stop_reason`,
SGLang in `matched_stop` / `finish_reason.matched`). Every generated token counts in the usage,
but the text ends before the stop string (unless vLLM's `include_stop_str_in_output` or
SGLang's `no_stop_trim`) and never shows a stop token. A stream holds back the last
`len(longest stop string) - 1` characters until they cannot start a match (vLLM's stop buffer).

The emulated model's tokens are one printable character each, so a character position in the
text is a token position: "visible" counts both.

A minimum length (vLLM's `min_tokens`, SGLang's `min_new_tokens`) keeps a stop token id from
ending the sequence before it: while fewer than `min_tokens` tokens exist, both engines mask EOS
and the stop token ids out of the logits (vLLM's MinTokensLogitsProcessor sets them to -inf over
`all_stop_token_ids`; SGLang's min-new-tokens penalizer), so another token is drawn in their
place. The emulated model does the same (`StopSpec.drawn`, applied where tokens are drawn,
`emulator.flows.tokens`): the first `min_tokens` tokens are never a stop id (nor EOS, which it
never draws at all), later ones may be and then end the sequence. vLLM also leaves stop strings
unchecked until the output is longer than `min_tokens`; SGLang checks them from the first token.
"""

from __future__ import annotations

from typing import Any

import msgspec

from emulator import tokenizer
from emulator.model import ALPHABET_IDS


class StopSpec(msgspec.Struct, frozen=True):
    strings: tuple[str, ...] = ()
    ids: frozenset[int] = frozenset()
    keep: bool = False  # the stop string stays in the text
    min_tokens: int = 0  # no stop id ends the first `min_tokens` tokens
    strings_wait: bool = False  # nor a stop string (vLLM)

    def drawn(self, tok: int, index: int) -> int:
        """The token drawn at output position `index` (0-based) where the model's own choice is
        `tok`: while fewer than `min_tokens` tokens exist a stop id is masked, and the most
        likely token left comes instead. After the chosen token the emulated model ranks its
        alphabet in order (`emulator.logprobs.alternatives`): the first of it not masked, else
        the first printable byte not masked. It depends on nothing but the model's choice, the
        position and the request's stop ids (the model's state goes on unchanged), so a P/D
        decode draws what its prefill drew, and what a colocated server draws."""
        if index >= self.min_tokens or tok not in self.ids:
            return tok
        return _unmasked(self.ids, tok)

    @property
    def hold(self) -> int:
        """Characters a stream keeps back while they might begin a stop string."""
        if self.keep or not self.strings:
            return 0
        return max(len(s) for s in self.strings) - 1


def stop_spec(
    params: dict[str, Any], keep_key: str, min_key: str, *, strings_wait: bool = False
) -> StopSpec | None:
    """The stop conditions of a request's parameters (the body on the OpenAI routes, SGLang's
    `sampling_params` on `/generate`); None when there are none. ValueError on a bad value.
    `min_key` names the minimum length (its range is checked elsewhere)."""
    raw = params.get("stop")
    if raw is None:
        strings: tuple[str, ...] = ()
    elif isinstance(raw, str):
        strings = (raw,)
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        strings = tuple(raw)
    else:
        raise ValueError("stop must be a string or a list of strings")
    if any(not x for x in strings):
        raise ValueError("stop strings must not be empty")
    ids_raw = params.get("stop_token_ids") or []
    if not isinstance(ids_raw, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in ids_raw
    ):
        raise ValueError("stop_token_ids must be a list of integers")
    if not strings and not ids_raw:
        return None
    return StopSpec(
        strings, frozenset(ids_raw), bool(params.get(keep_key)), _min_len(params.get(min_key)), strings_wait
    )


_PRINTABLE_IDS = tuple(b + tokenizer.BYTE_OFFSET for b in range(32, 127))


def _unmasked(masked: frozenset[int], tok: int) -> int:
    for alt in ALPHABET_IDS:
        if alt not in masked:
            return alt
    for alt in _PRINTABLE_IDS:
        if alt not in masked:
            return alt
    return tok  # every printable token masked: no text could be drawn; the engines' outcome is noise


def _min_len(raw: Any) -> int:
    """The minimum length as an engine reads it; 0 for a value its own checks refuse."""
    if isinstance(raw, bool):
        return 0
    try:
        return max(0, int(raw)) if isinstance(raw, (int, str)) else 0
    except ValueError:
        return 0


class Stopper:
    """Watches one sequence's tokens for its stop conditions."""

    __slots__ = ("matched", "produced", "spec", "text", "visible")

    def __init__(self, spec: StopSpec) -> None:
        self.spec = spec
        self.produced = 0
        self.text = ""
        self.matched: str | int | None = None
        self.visible = 0  # tokens (characters) of the text a client sees once stopped

    def feed(self, tok: int) -> bool:
        """Add a generated token; True when it ends the sequence."""
        spec = self.spec
        self.produced += 1
        early = self.produced <= spec.min_tokens
        if tok in spec.ids and not early:
            self.matched, self.visible = tok, len(self.text)
            return True
        if not spec.strings or (early and spec.strings_wait):
            self.text += tokenizer.token_text(tok)
            return False
        before = len(self.text)
        self.text += tokenizer.token_text(tok)
        best: tuple[int, str] | None = None
        for s in spec.strings:  # only a match the new token completes (vLLM's window)
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        at, s = best
        self.matched = s
        self.visible = at + len(s) if spec.keep else at
        return True

    def shown(self, produced: int, final: bool) -> int:
        """How many of the `produced` tokens a stream may show now."""
        if self.matched is not None:
            return min(self.visible, produced)
        if final:
            return produced
        return max(0, produced - self.spec.hold)
