"""Pydantic's lax mode for the OpenAI routes' scalar fields, where msgspec's lax mode is stricter.

Both engines parse `/v1/completions` and `/v1/chat/completions` with pydantic v2 models in lax
mode, which take more than msgspec's lax mode (`common.request`'s one decode): `"stream": "yes"`,
`"on"`, `"Y"` or `1.0`; `"max_tokens": " 3 "`, `true` or `"1_000"`; `"temperature": true`,
`" 0.5 "` or `"1e400"`. Only a body the fast decode refused comes here: its scalar fields that
the gateway reads are rewritten as pydantic would read them, and it is decoded again. A value
pydantic refuses (`2.5` for a count, `"abc"`, `" true "` for a flag) is left as sent, for the
second decode to refuse in its own words. The values of every other key (the prompt, messages)
are msgspec.Raw, encoded again verbatim; the engines are sent the client's bytes, not these.

The rules are pydantic-core's (src/input/shared.rs: `str_as_bool`, `str_as_int` with
`clean_int_str`, `str_as_float`, `float_as_int`), checked against the installed pydantic by
tests/unit/test_lax_fields.py.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

# Rust's `str::trim`: the Unicode White_Space characters (not Python's `str.isspace`, which also
# takes \x1c-\x1f)
_WS = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
# ASCII-case-insensitive, never stripped: " true " is refused
_FALSE = frozenset(("0", "f", "n", "no", "off", "false"))
_TRUE = frozenset(("1", "t", "y", "on", "yes", "true"))
_JSON_INT = re.compile(r"-?(?:0|[1-9][0-9]*)", re.ASCII)
# Rust's f64 `from_str` (what pydantic-core parses a float string with)
_RUST_FLOAT = re.compile(
    r"[+-]?(?:inf|infinity|nan|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)", re.ASCII | re.IGNORECASE
)
_MAX_DIGITS = 4300  # jiter's (and CPython's) bound on an integer's decimal digits
_I64 = float(2**63)


def lax_bool(v: Any) -> bool | None:
    """`v` (a decoded JSON value) as pydantic's lax bool, or None where pydantic refuses it."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float):  # 0 and 1 only (0.0, -0.0 and 1.0 too)
        return False if v == 0 else True if v == 1 else None
    if isinstance(v, str) and v.isascii():
        w = v.lower()
        if w in _TRUE:
            return True
        if w in _FALSE:
            return False
    return None


def lax_int(v: Any) -> int | None:
    """`v` as pydantic's lax int, or None where pydantic refuses it."""
    if isinstance(v, int):  # (bool too: 0 or 1)
        return int(v)
    if isinstance(v, float):
        if not math.isfinite(v) or not v.is_integer() or not -_I64 < v < _I64:
            return None
        return int(v)
    if isinstance(v, str):
        return _str_as_int(v)
    return None


def lax_float(v: Any) -> float | None:
    """`v` as pydantic's lax float, or None where pydantic refuses it."""
    if isinstance(v, float):
        return v
    if isinstance(v, int):  # (bool too)
        try:
            return float(v)
        except OverflowError:  # a JSON integer past a double's range: pydantic's is infinite
            return math.inf if v > 0 else -math.inf
    if isinstance(v, str):
        t = v.strip(_WS)
        if _RUST_FLOAT.fullmatch(t):
            return float(t)
        u = _strip_underscores(v)  # (of the string as sent: " 1_000 " is refused)
        if u is not None and _RUST_FLOAT.fullmatch(u):
            return float(u)
    return None


def _str_as_int(s: str) -> int | None:
    if _JSON_INT.fullmatch(s):
        return _bounded_int(s)
    t = s.strip(_WS)
    if t.startswith("+"):
        t = t[1:]
        if t.startswith("-"):
            return None
    negative = t.startswith("-")
    if negative:
        t = t[1:]
        if t.startswith(("-", "+")):
            return None
    stripped = _strip_leading_zeros(t)
    if stripped is None:
        return None
    t = stripped
    dot = t.find(".")
    if dot >= 0 and t[dot + 1 :] and t[dot + 1 :].strip("0") == "":
        t = t[:dot]
    u = _strip_underscores(t)
    if u is not None:
        t = u
    elif len(t) == len(s):  # nothing was cleaned: the first parse's refusal stands
        return None
    t = "-" + t if negative else t
    return _bounded_int(t) if _JSON_INT.fullmatch(t) else None


def _bounded_int(s: str) -> int | None:
    return int(s) if len(s.lstrip("-")) <= _MAX_DIGITS else None


def _strip_leading_zeros(s: str) -> str | None:
    """pydantic-core's `strip_leading_zeros`, quirks included (`"0-1"` is -1 there)."""
    if not s:
        return None
    if s[0] != "0":
        return s if s[0] in "123456789-" else None
    for i in range(1, len(s)):
        c = s[i]
        if c in "0_":
            continue
        if c in "123456789-":
            return s[i:]
        if c == ".":
            return s[i - 1 :]
        return None
    return s[-1:]


def _strip_underscores(s: str) -> str | None:
    if s.startswith("_") or s.endswith("_") or "_" not in s or "__" in s:
        return None
    return s.replace("_", "")


_BOOL_FIELDS = ("stream", "echo")
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "n", "top_k")
_FLOAT_FIELDS = ("temperature",)
_RULES: tuple[tuple[tuple[str, ...], Callable[[Any], Any]], ...] = (
    (_BOOL_FIELDS, lax_bool),
    (_INT_FIELDS, lax_int),
    (_FLOAT_FIELDS, lax_float),
)

_dict_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder = msgspec.json.Encoder()


def coerce_openai_fields(body: bytes) -> bytes | None:
    """`body` (a JSON object) with the scalar fields the gateway reads (`common.fields.Fields`'
    stream, echo, max_tokens, max_completion_tokens, n, top_k, temperature and
    stream_options.include_usage) written as pydantic's lax mode reads them, every other value
    as sent; None where `body` is no JSON object. A key given twice is given once, its last
    value (as pydantic and msgspec read it: `"stream": "yes"` then `false` is false)."""
    try:
        fields = _dict_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # (decoding a value as Raw recurses into it)
        return None
    for names, rule in _RULES:
        for name in names:
            raw = fields.get(name)
            if raw is not None and (new := _coerce(raw, rule)) is not None:
                fields[name] = new
    raw = fields.get("stream_options")
    if raw is not None and bytes(raw)[:1] == b"{":
        opts = _dict_decoder.decode(raw)  # (a valid object: the whole body decoded)
        usage = opts.get("include_usage")
        if usage is not None and (new := _coerce(usage, lax_bool)) is not None:
            opts["include_usage"] = new
        fields["stream_options"] = msgspec.Raw(_encoder.encode(opts))  # (once each key, here too)
    return _encoder.encode(fields)


def _coerce(raw: msgspec.Raw, rule: Callable[[Any], Any]) -> msgspec.Raw | None:
    """The raw value as `rule` reads it, encoded; None where it is refused or unchanged."""
    data = bytes(raw)
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:  # a number past msgspec's range (1e400): Python reads it as jiter does
        value = _number(data)
    if value is None:
        return None
    got = rule(value)
    if got is None:
        return None
    if isinstance(got, float) and not math.isfinite(got):
        encoded = _encoder.encode(str(got))  # "inf", "-inf", "nan": msgspec's lax float reads them
    else:
        encoded = _encoder.encode(got)
    return None if encoded == data else msgspec.Raw(encoded)


def _number(data: bytes) -> int | float | None:
    try:
        return float(data) if any(c in data for c in b".eE") else int(data)
    except ValueError:
        return None
