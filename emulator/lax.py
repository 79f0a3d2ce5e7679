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


def _lax_ids(items: list[Any]) -> list[int] | None:
    out: list[int] = []
    for x in items:
        if isinstance(x, int):  # (bool too: pydantic's lax int)
            out.append(int(x))
        elif isinstance(x, float) and x.is_integer():
            out.append(int(x))
        elif isinstance(x, str) and x.strip().lstrip("+-").isdigit():
            out.append(int(x))
        else:
            return None
    return out
