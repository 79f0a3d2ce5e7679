"""Pydantic's lax mode for the OpenAI routes' scalar fields, as both engines parse them.

SGLang's and vLLM's request models are pydantic v2 models that FastAPI validates from the decoded
JSON in lax (python) mode: `"5"`, `" 5 "`, `"5.0"` and `5.0` are the integer 5, `"no"`, `"OFF"` and
`0` are false, `"0.5"` is 0.5. What pydantic refuses (`"abc"` or `2.5` for a count, `" true "`
for a flag) is a validation error while the request is parsed: the caller answers 400 with it,
before any work. The rules below are pydantic-core 2's (checked against pydantic 2.14):

- int: a bool, an int, a float with no fractional part inside the signed 64-bit range, or a
  string that is a JSON integer as it stands or once cleaned of Unicode whitespace, a leading
  `+`, leading zeros, a `.000` tail and single inner underscores (`" 5 "`, `"+5"`, `"5.00"`,
  `"1_000"`; not `"1e3"`, `"5."` or other scripts' digits; pydantic-core's quirks included:
  `"0-9"` is -9);
- float: a bool, an int a double holds, a float, or a string Rust's float parser takes once
  stripped (`"1e3"`, `".5"`, `"inf"`, `"nan"`), or once single inner underscores are dropped
  from it unstripped;
- bool: a bool, 0 or 1 (`0.0`/`1.0` too), or one of the words below in any case, *not* stripped.

Only the fields the emulator reads are checked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgspec

_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "f", "false", "n", "no", "off"))
_BOOLS = ("stream", "echo", "ignore_eos", "skip_special_tokens", "add_generation_prompt")
_INTS = ("max_tokens", "max_completion_tokens", "n", "min_tokens", "top_k", "seed", "top_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

# Rust's str::trim (the Unicode White_Space property): not Python's str.strip, which also takes
# U+001C-U+001F
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_JSON_INT = re.compile(r"-?(?:0|([1-9][0-9]*))")
_FLOAT_STR = re.compile(r"[+-]?(?:inf|infinity|nan|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)", re.I)
_INT_DIGITS_MAX = 4300  # more is int_parsing_size (Python's own int() limit)
_I64 = 2**63

_INT_TYPE = "Input should be a valid integer"
_INT_PARSING = "Input should be a valid integer, unable to parse string as an integer"
_INT_FROM_FLOAT = "Input should be a valid integer, got a number with a fractional part"
_INT_SIZE = "Unable to parse input string as an integer, exceeded maximum size"
_FINITE = "Input should be a finite number"
_FLOAT_TYPE = "Input should be a valid number"
_FLOAT_PARSING = "Input should be a valid number, unable to parse string as a number"
_BOOL_TYPE = "Input should be a valid boolean"
_BOOL_PARSING = "Input should be a valid boolean, unable to interpret input"


class Invalid(msgspec.Struct, frozen=True):
    """A value pydantic refuses for its field, with pydantic's message."""

    msg: str


def lax_bool(v: Any) -> bool | Invalid:
    """A ``bool`` field's value, or pydantic's refusal."""
    if isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer() and -_I64 < v < _I64:
        v = int(v)  # an integral float is read as the int it is
    if isinstance(v, int):
        if v in (0, 1):
            return bool(v)
        return Invalid(_BOOL_PARSING if -_I64 <= v < _I64 else _BOOL_TYPE)
    if isinstance(v, str):
        w = v.lower()  # no strip: " true " is refused
        if w in _TRUE:
            return True
        if w in _FALSE:
            return False
        return Invalid(_BOOL_PARSING)
    return Invalid(_BOOL_TYPE)


def lax_int(v: Any) -> int | Invalid:
    """An ``int`` field's value, or pydantic's refusal."""
    if isinstance(v, int):  # (bool too: True is 1)
        return int(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return Invalid(_FINITE)
        if not v.is_integer():
            return Invalid(_INT_FROM_FLOAT)
        return int(v) if -_I64 < v < _I64 else Invalid(_INT_SIZE)
    if isinstance(v, str):
        n = _json_int(v)
        if n is not None:
            return n
        cleaned = _clean_int_str(v)
        n = _json_int(cleaned) if cleaned is not None else None
        return n if isinstance(n, int) else Invalid(_INT_PARSING)
    return Invalid(_INT_TYPE)


def _json_int(s: str) -> int | Invalid | None:
    """`s` read whole as a JSON integer (jiter's NumberInt): its value, a size refusal (more
    than 4300 digits, found before what follows them), or None (not a JSON integer)."""
    m = _JSON_INT.match(s)
    if m is None:
        return None
    if len(m.group(1) or "") > _INT_DIGITS_MAX:
        return Invalid(_INT_SIZE)
    return int(s) if m.end() == len(s) else None


def _clean_int_str(v: str) -> str | None:
    """pydantic-core's second reading of an int string: stripped of whitespace, a leading `+`,
    leading zeros (underscores among them), a `.000` tail and single inner underscores; None
    where none of that applies or it is malformed."""
    s = v.strip(_WHITESPACE)
    if s.startswith("+"):
        s = s[1:]
        if s.startswith("-"):
            return None
    neg = s.startswith("-")
    if neg:
        s = s[1:]
        if s.startswith(("-", "+")):
            return None
    stripped = _strip_leading_zeros(s)
    if stripped is None:
        return None
    s = stripped
    head, dot, tail = s.partition(".")
    if dot and tail and tail.strip("0") == "":
        s = head
    if not s.startswith("_") and not s.endswith("_") and "_" in s and "__" not in s:
        return "-" * neg + s.replace("_", "")
    if len(s) == len(v):
        return None  # nothing to clean: the first reading's refusal stands
    return "-" * neg + s


def _strip_leading_zeros(s: str) -> str | None:
    """Leading zeros (and underscores after the first) dropped, one kept before a `.` or when
    all are zeros. What follows them is not checked: pydantic-core reads `"0-9"` as -9."""
    if not s or s[0] in "123456789-":
        return s or None
    if s[0] != "0":
        return None
    for i, c in enumerate(s[1:], 1):
        if c in "123456789-":
            return s[i:]
        if c == ".":
            return s[i - 1 :]
        if c not in "0_":
            return None
    return s[-1]


def lax_float(v: Any) -> float | Invalid:
    """A ``float`` field's value, or pydantic's refusal."""
    if isinstance(v, float):
        return v
    if isinstance(v, int):  # (bool too)
        try:
            return float(v)
        except OverflowError:  # an int no double holds
            return Invalid(_FLOAT_TYPE)
    if isinstance(v, str):
        s = v.strip(_WHITESPACE)
        if _FLOAT_STR.fullmatch(s) is not None:
            return float(s)
        # pydantic-core's second try: single underscores dropped from the unstripped string
        # ("1_0.5", "1e_3"), none leading, trailing or doubled
        if not v.startswith("_") and not v.endswith("_") and "__" not in v:
            s = v.replace("_", "")
            if _FLOAT_STR.fullmatch(s) is not None:
                return float(s)
        return Invalid(_FLOAT_PARSING)
    return Invalid(_FLOAT_TYPE)


_LIST_TYPE = "Input should be a valid list"
_STRING_TYPE = "Input should be a valid string"
_MM_PAYLOAD = "Input should be 'tensors' or 'none'"

# vLLM's request-model fields typed without `| None` (0.32: CompletionRequest in
# entrypoints/openai/completion/protocol.py, ChatCompletionRequest in
# entrypoints/openai/chat_completion/protocol.py), in declaration order, with pydantic's refusal
# of a JSON null for each (checked by validating each model with each field null). A null for
# any other field is its default (the `| None` ones; `stop`, whose StopParam takes None;
# `max_tokens`, set to its default by normalize_null_max_tokens).
VLLM_NO_NULL_COMPLETIONS: tuple[tuple[str, str], ...] = (
    ("n", _INT_TYPE),
    ("use_beam_search", _BOOL_TYPE),
    ("length_penalty", _FLOAT_TYPE),
    ("include_stop_str_in_output", _BOOL_TYPE),
    ("ignore_eos", _BOOL_TYPE),
    ("min_tokens", _INT_TYPE),
    ("skip_special_tokens", _BOOL_TYPE),
    ("spaces_between_special_tokens", _BOOL_TYPE),
    ("bad_words", _LIST_TYPE),
    ("add_special_tokens", _BOOL_TYPE),
    ("priority", _INT_TYPE),
    ("request_id", _STRING_TYPE),
    ("routed_experts_prompt_start", _INT_TYPE),
    ("mm_payload", _MM_PAYLOAD),
)
VLLM_NO_NULL_CHAT: tuple[tuple[str, str], ...] = (  # (chat's `n` is `int | None`, its `echo` a bool)
    ("include_reasoning", _BOOL_TYPE),
    ("use_beam_search", _BOOL_TYPE),
    ("length_penalty", _FLOAT_TYPE),
    ("include_stop_str_in_output", _BOOL_TYPE),
    ("ignore_eos", _BOOL_TYPE),
    ("min_tokens", _INT_TYPE),
    ("skip_special_tokens", _BOOL_TYPE),
    ("spaces_between_special_tokens", _BOOL_TYPE),
    ("bad_words", _LIST_TYPE),
    ("echo", _BOOL_TYPE),
    ("add_generation_prompt", _BOOL_TYPE),
    ("continue_final_message", _BOOL_TYPE),
    ("add_special_tokens", _BOOL_TYPE),
    ("priority", _INT_TYPE),
    ("request_id", _STRING_TYPE),
    ("routed_experts_prompt_start", _INT_TYPE),
    ("mm_payload", _MM_PAYLOAD),
)


def coerce_openai(body: dict[str, Any], chat: bool, no_null: tuple[tuple[str, str], ...] = ()) -> str | None:
    """Coerce `body`'s scalar fields in place (completions: `logprobs` is a count; chat: a flag)
    and answer the validation error pydantic raises for those it refuses, or None. A null is
    read as absent, but for the fields of `no_null` (field, pydantic's refusal of a null: the
    engine's model types them without `| None`)."""
    refused: list[str] = [f"{k}: {msg}" for k, msg in no_null if k in body and body[k] is None]

    def each(
        obj: dict[str, Any], keys: tuple[str, ...], conv: Callable[[Any], object], prefix: str = ""
    ) -> None:
        for k in keys:
            if obj.get(k) is None:
                continue
            v = conv(obj[k])
            if isinstance(v, Invalid):
                refused.append(f"{prefix}{k}: {v.msg}")
            else:
                obj[k] = v

    each(body, _BOOLS, lax_bool)
    each(body, _INTS, lax_int)
    each(body, _FLOATS, lax_float)
    each(body, ("logprobs",), lax_bool if chat else lax_int)
    so = body.get("stream_options")
    if isinstance(so, dict):
        each(so, ("include_usage", "continuous_usage_stats"), lax_bool, "stream_options.")
    if not refused:
        return None
    n = len(refused)
    return f"{n} validation error{'s' if n > 1 else ''}: " + "; ".join(refused)


def vllm_seed_error(body: dict[str, Any]) -> str | None:
    """vLLM's `seed` field is bounded to a signed 64-bit int (`Field(ge=..., le=...)` on its
    request models); a seed outside it is a validation error, not a wrapped seed."""
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        return None
    if seed > 2**63 - 1:
        return f"1 validation error: seed: Input should be less than or equal to {2**63 - 1}"
    if seed < -(2**63):
        return f"1 validation error: seed: Input should be greater than or equal to {-(2**63)}"
    return None


def normalize_openai_prompt(body: dict[str, Any], chat: bool) -> str | None:
    """The prompt's shape as both engines' request schemas (pydantic, lax mode) check it, or
    None: chat `messages` an array of objects with a string `role`; completions `prompt` a
    string, a list of strings, token ids, or a list of token-id lists. A token id may come as
    `true`, `2.0` or `"7"` (pydantic's lax int); such a prompt is rewritten in place to plain
    ids, as the engine reads it. Refused while the request is parsed: a 400, never a crash."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            return "1 validation error: messages: Input should be a list of message objects with a role"
        return None
    p = body.get("prompt")
    if p is None or isinstance(p, str):
        return None  # (a missing prompt is each engine's own error)
    if isinstance(p, list) and all(isinstance(x, str) for x in p):
        return None
    if isinstance(p, list):
        if p and all(isinstance(x, list) for x in p):
            lists = [_lax_ids(x) for x in p]
            if all(x is not None for x in lists):
                body["prompt"] = lists
                return None
        elif (one := _lax_ids(p)) is not None:
            body["prompt"] = one
            return None
    return (
        "1 validation error: prompt: Input should be a string, a list of strings, "
        "a list of token ids or a list of token id lists"
    )


def lax_token_ids(value: Any) -> list[int] | None:
    """A `list[int]` field read as pydantic's lax mode reads it (SGLang's chat `input_ids`), or
    None when it refuses it."""
    return _lax_ids(value) if isinstance(value, list) else None


def _lax_ids(items: list[Any]) -> list[int] | None:
    """Token ids as pydantic's lax int reads each (`true`, `2.0`, `" 7"`; not `"²"` or other
    scripts' digits, which Python's int() would take), or None if one is refused."""
    out: list[int] = []
    for x in items:
        v = lax_int(x)
        if isinstance(v, Invalid):
            return None
        out.append(v)
    return out
