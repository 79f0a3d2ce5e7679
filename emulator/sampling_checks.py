"""The range checks both engines make of a request's sampling parameters before it reaches their
scheduler, with the engines' own messages. Each function answers None (accepted) or the refusal;
the API modules turn a refusal into the engine's answer before any work starts (no admission, no
KV transfer, no bootstrap room). A request that sends none of these fields pays a few dict
lookups.

vLLM 0.32 (``vllm/sampling_params.py``, ``SamplingParams._verify_args``): the OpenAI request's
pydantic fields have already turned ints into floats (``temperature: -1`` is reported as
``-1.0``); a check raised with ``parameter=`` names it in the error's ``param`` and its message
ends in `` (parameter=..., value=...)`` (``VLLMValidationError.__str__``, vllm/exceptions.py).

SGLang 0.5.23 (``sglang/srt/sampling/sampling_params.py``, ``SamplingParams.__post_init__`` and
``verify``): ``/generate`` checks its ``sampling_params`` as sent (``temperature: -1`` is
reported as ``-1``); the OpenAI routes first fill their pydantic fields (floats as floats) and
map them (``min_tokens`` -> ``min_new_tokens``, ``seed`` -> ``sampling_seed``, chat's
``max_completion_tokens or max_tokens`` -> ``max_new_tokens``). Before ``verify``, a temperature
in ``[0, 1e-6)`` becomes greedy (temperature 1, top_k 1) and top_k -1 (or none) the whole
vocabulary.

Values of a type the engine refuses earlier (pydantic, SGLang's ``/generate`` JSON contract)
and non-finite values (the emulator's JSON decoder refuses ``NaN``/``Infinity``/``1e999``) are
left alone here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_SGLANG_SAMPLING_EPS = 1e-6  # sglang/srt/sampling/sampling_params.py:42
_SGLANG_TOP_K_ALL = 1 << 30  # sglang/srt/sampling/sampling_params.py:43


def _as_float(v: Any) -> float | None:
    """A pydantic ``float`` field's value (lax mode: ints and bools convert), or None."""
    return float(v) if isinstance(v, int | float) else None


def _as_int(v: Any) -> int | None:
    """A pydantic ``int`` field's value (lax mode: integral floats and bools convert), or None."""
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _number(v: Any) -> int | float | None:
    """A ``/generate`` value as SGLang's JSON contract admits a float field (no bools)."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


def _integer(v: Any) -> int | None:
    """A ``/generate`` value as SGLang's JSON contract admits an integer field (no bools)."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# ---------------------------------------------------------------------------------------- vLLM
def _vllm_param(message: str, param: str, value: Any) -> tuple[str, str]:
    return f"{message} (parameter={param}, value={value})", param


def vllm_refusal(body: Mapping[str, Any], max_tokens: list[int]) -> tuple[str, str | None] | None:
    """vLLM's refusal of `body`'s sampling parameters as ``(message, param)``, or None.
    `max_tokens`: each prompt's ``max_tokens`` as the engine sets it (``get_max_tokens``,
    entrypoints/serve/utils/api_utils.py:169-205: the request's, clamped to the room its prompt
    leaves; echo without generation: 1). Order and messages: vllm/sampling_params.py:635-702."""
    get = body.get
    v = get("presence_penalty")
    if v is not None and (f := _as_float(v)) is not None and not -2.0 <= f <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {f}.", None  # :635
    v = get("frequency_penalty")
    if v is not None and (f := _as_float(v)) is not None and not -2.0 <= f <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {f}.", None  # :639
    v = get("repetition_penalty")
    if v is not None and (f := _as_float(v)) is not None:
        if not math.isfinite(f):
            return f"repetition_penalty must be a finite number, got {f}.", None  # :643
        if f <= 0.0:
            return f"repetition_penalty must be greater than zero, got {f}.", None  # :648
    v = get("temperature")
    if v is not None and (f := _as_float(v)) is not None:
        if not math.isfinite(f):
            return _vllm_param(f"temperature must be a finite number, got {f}.", "temperature", f)  # :653
        if f < 0.0:
            return _vllm_param(f"temperature must be non-negative, got {f}.", "temperature", f)  # :659
        if f > 2.0:
            return _vllm_param(f"temperature must be in [0, 2], got {f}.", "temperature", f)  # :665
    v = get("top_p")
    if v is not None and (f := _as_float(v)) is not None and not 0.0 < f <= 1.0:
        return _vllm_param(f"top_p must be in (0, 1], got {f}.", "top_p", f)  # :671
    v = get("top_k")
    if v is not None and (k := _as_int(v)) is not None and k < -1:
        return f"top_k must be 0 (disable), or at least 1, got {k}.", None  # :678
    v = get("min_p")
    if v is not None and (f := _as_float(v)) is not None and not 0.0 <= f <= 1.0:
        return f"min_p must be in [0, 1], got {f}.", None  # :686
    v = get("min_tokens")
    m = _as_int(v) if v is not None else None
    for mt in max_tokens:  # one SamplingParams per prompt, in order
        if mt < 1:  # get_max_tokens leaves 0 when the prompt fills the context (or asked < 1)
            return _vllm_param(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)  # :688
        if m is not None and m < 0:
            return f"min_tokens must be greater than or equal to 0, got {m}.", None  # :694
        if m is not None and m > mt:
            return f"min_tokens must be less than or equal to max_tokens={mt}, got {m}.", None  # :698
    return None


# -------------------------------------------------------------------------------------- SGLang
def _sglang_verify(
    get: Callable[[str], Any],
    number: Callable[[Any], int | float | None],
    integer: Callable[[Any], int | None],
    min_new_tokens: int | None,
    max_new_tokens: int | None,
    sampling_seed: int | None,
) -> str | None:
    """SGLang's ``SamplingParams.__post_init__`` defaults and greedy mapping, then ``verify``'s
    range checks in its order (sglang/srt/sampling/sampling_params.py:191-250, 252-312). The
    parameters every route names alike are read through `get` with the route's own view of a
    value (`number`, `integer`); the three whose names differ come read."""
    temperature, top_p, top_k = number(get("temperature")), number(get("top_p")), integer(get("top_k"))
    t = 1.0 if temperature is None else temperature
    k = -1 if top_k is None else top_k
    if 0 <= t < _SGLANG_SAMPLING_EPS:  # :245 greedy
        t, k = 1.0, 1
    if k == -1:  # :249
        k = _SGLANG_TOP_K_ALL
    if not math.isfinite(t) or t < 0.0:
        return f"temperature must be a non-negative finite number, got {t}."  # :255
    p = 1.0 if top_p is None else top_p
    if not 0.0 < p <= 1.0:
        return f"top_p must be in (0, 1], got {p}."  # :259
    min_p = number(get("min_p"))
    mp = 0.0 if min_p is None else min_p
    if not 0.0 <= mp <= 1.0:
        return f"min_p must be in [0, 1], got {mp}."  # :261
    if k < 1 or k == -1:
        return f"top_k must be -1 (disable) or at least 1, got {k}."  # :263
    frequency_penalty = number(get("frequency_penalty"))
    fp = 0.0 if frequency_penalty is None else frequency_penalty
    if not -2.0 <= fp <= 2.0:
        return f"frequency_penalty must be in [-2, 2], got {fp}."  # :267
    presence_penalty = number(get("presence_penalty"))
    pp = 0.0 if presence_penalty is None else presence_penalty
    if not -2.0 <= pp <= 2.0:
        return f"presence_penalty must be in [-2, 2], got {pp}."  # :271
    repetition_penalty = number(get("repetition_penalty"))
    rp = 1.0 if repetition_penalty is None else repetition_penalty
    if not 0.0 < rp <= 2.0:
        return f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rp}."  # :275
    mn = 0 if min_new_tokens is None else min_new_tokens
    if not 0 <= mn:
        return f"min_new_tokens must be in [0, max_new_tokens], got {mn}."  # :280
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            return f"max_new_tokens must be at least 0, got {max_new_tokens}."  # :286
        if not mn <= max_new_tokens:
            return f"min_new_tokens must be in [0, max_new_tokens({max_new_tokens})], got {mn}."  # :290
    if sampling_seed is not None and not _INT64_MIN <= sampling_seed <= _INT64_MAX:
        return f"sampling_seed must be in [-2**63, 2**63 - 1], got {sampling_seed}."  # :308
    return None


_SGLANG_COMMON_KEYS = frozenset(
    ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")
)
_SGLANG_GENERATE_KEYS = _SGLANG_COMMON_KEYS | {"min_new_tokens", "max_new_tokens", "sampling_seed"}
_SGLANG_OPENAI_KEYS = _SGLANG_COMMON_KEYS | {"min_tokens", "seed"}
_SGLANG_CHAT_KEYS = _SGLANG_OPENAI_KEYS | {"max_tokens", "max_completion_tokens"}


def sglang_generate_refusal(sp: Mapping[str, Any]) -> str | None:
    """SGLang's refusal of one ``/generate`` ``sampling_params`` object (values as sent), or None."""
    if sp.keys().isdisjoint(_SGLANG_GENERATE_KEYS):
        return None  # the defaults (max_new_tokens 128) pass
    get = sp.get
    return _sglang_verify(
        get,
        _number,
        _integer,
        _integer(get("min_new_tokens")),
        _integer(get("max_new_tokens", 128)),  # SamplingParams' default; an explicit null stays
        _integer(get("sampling_seed")),
    )


def sglang_openai_refusal(body: Mapping[str, Any], chat: bool) -> str | None:
    """SGLang's refusal of an OpenAI request's sampling parameters, or None. Completions:
    ``CompletionRequest`` fields into ``serving_completions._build_sampling_params``; chat:
    ``ChatCompletionRequest.to_sampling_params`` (sglang/srt/entrypoints/openai/protocol.py)."""
    if body.keys().isdisjoint(_SGLANG_CHAT_KEYS if chat else _SGLANG_OPENAI_KEYS):
        return None  # the defaults pass (completions' max_tokens is its validator's)
    get = body.get
    if chat:
        mt = _as_int(get("max_completion_tokens") or get("max_tokens"))
    else:
        mt = _as_int(get("max_tokens", 16))  # <= 0 is refused by its pydantic validator first
    return _sglang_verify(get, _as_float, _as_int, _as_int(get("min_tokens")), mt, _as_int(get("seed")))
