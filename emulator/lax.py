"""Pydantic's lax mode for the OpenAI routes' scalar fields, as both engines parse them.

SGLang's and vLLM's request models are pydantic v2 models in lax mode: `"5"` and `5.0` are the
integer 5, `"false"`, `"no"` and `0` are false, `"0.5"` is 0.5. A fractional count (`5.5`) or an
unknown word stays as it was, for the emulator's own checks to refuse. Only the fields the
emulator reads are coerced.
"""

from __future__ import annotations

from typing import Any

_TRUE = frozenset(("1", "on", "t", "true", "y", "yes"))
_FALSE = frozenset(("0", "f", "false", "n", "no", "off"))
_BOOLS = ("stream", "echo", "ignore_eos", "skip_special_tokens", "add_generation_prompt")
_INTS = ("max_tokens", "max_completion_tokens", "n", "min_tokens", "top_k", "seed", "top_logprobs")
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def _bool(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str):
        w = v.strip().lower()
        if w in _TRUE:
            return True
        if w in _FALSE:
            return False
    return v


def _int(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return v
    return v


def _float(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            return v
    return v


def coerce_openai(body: dict[str, Any], chat: bool) -> None:
    """Coerce `body`'s scalar fields in place (completions: `logprobs` is a count; chat: a flag)."""
    for k in _BOOLS:
        if k in body:
            body[k] = _bool(body[k])
    for k in _INTS:
        if k in body:
            body[k] = _int(body[k])
    for k in _FLOATS:
        if k in body:
            body[k] = _float(body[k])
    if "logprobs" in body:
        body["logprobs"] = _bool(body["logprobs"]) if chat else _int(body["logprobs"])
    so = body.get("stream_options")
    if isinstance(so, dict):
        for k in ("include_usage", "continuous_usage_stats"):
            if k in so:
                so[k] = _bool(so[k])
