"""`n > 1` and batches cut into requests of one prompt and one sample each (SGLang's P/D pairs one
sample per bootstrap room: adapters/sglang.py `split_units`, gateway/samples.py for why and for
the merge of the answers).

Unit `k = prompt_index * n + j` is prompt `prompt_index` of a batch, sample `j` (`n` = 1, and
`seed + j` when a seed is given, so seeded samples differ and are reproducible), a request of
its own. Which fields a `/generate` batch gives per prompt is SGLang's `GenerateReqInput`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.request import ParsedRequest, parse_request
from common.workers import RouteKind

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


def _one_sample(params: dict[str, Any], seed_key: str, j: int) -> dict[str, Any]:
    out = dict(params)
    out["n"] = 1
    seed = out.get(seed_key)
    if seed is not None and j:
        out[seed_key] = sample_seed(seed, j)
    return out


def sample_seed(seed: Any, j: int) -> Any:
    """Sample `j`'s seed: `seed + j` (as the engines seed an `n > 1` request's samples), inside
    int64 (the range both engines take: past its top it wraps around to its bottom). A seed in
    a form the engines' schemas read as an integer (pydantic's lax mode: "5", " +5 ", 5.0, true)
    counts as that integer; anything else is sent as it came, for the engine to judge."""
    if seed.__class__ is not int:
        if isinstance(seed, bool) or (isinstance(seed, float) and seed.is_integer()):
            seed = int(seed)
        elif isinstance(seed, str) and seed.strip().lstrip("+-").isdigit():
            seed = int(seed.strip())
        else:
            return seed
    return (seed + j + _INT64) % (2 * _INT64) - _INT64


_INT64 = 2**63


# `/generate` fields that a batch gives per prompt (SGLang's GenerateReqInput): a list with one
# entry per prompt is cut to the prompt's entry; anything else is shared as sent
_PER_PROMPT = (
    "text",
    "input_ids",
    "input_embeds",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "lora_path",
    "lora_id",
    "image_data",
    "video_data",
    "audio_data",
    "custom_logit_processor",
    "return_hidden_states",
)


def _prompt_of(req: ParsedRequest, fields: dict[str, Any], i: int) -> None:
    """Cut a batch's fields down to prompt `i`'s, in place."""
    if req.route is not RouteKind.GENERATE:
        fields["prompt"] = fields["prompt"][i]
        return
    for key in _PER_PROMPT:
        v = fields.get(key)
        if not isinstance(v, list) or len(v) != req.batch:
            continue
        if key == "token_ids_logprob" and not all(isinstance(x, list) or x is None for x in v):
            continue  # one list of ids, shared by every prompt
        fields[key] = v[i]


def split_units(req: ParsedRequest) -> list[ParsedRequest]:
    """Every unit of `req`, in order (each built, and so checked, before any is sent)."""
    body = _decode.decode(req.body)
    return [sample_request(req, k, body) for k in range(req.units)]


def sample_request(req: ParsedRequest, k: int, body: dict[str, Any] | None = None) -> ParsedRequest:
    """Unit `k = prompt_index * n + j` of `req` as a request of its own: one prompt of a batch,
    sample `j` (n = 1). A client's `rid` is dropped: the units are engine requests each named by
    the gateway. `body`: `req.body` decoded (once for all units; not changed here)."""
    fields: dict[str, Any] = dict(body) if body is not None else _decode.decode(req.body)
    fields.pop("rid", None)
    i, j = divmod(k, req.n)
    if req.is_batch:
        _prompt_of(req, fields, i)
    if req.route is RouteKind.GENERATE:
        sp = fields.get("sampling_params")  # one object: a batch's list was cut to its prompt's
        fields["sampling_params"] = _one_sample(sp if isinstance(sp, dict) else {}, "sampling_seed", j)
    else:
        fields = _one_sample(fields, "seed", j)
    return parse_request(
        req.route, req.path, _encode(fields), default_model=req.model, max_n=1, max_tokens_cap=None
    )
