"""A request's work items as SGLang's tokenizer manager expands them, and their results.

``n > 1`` (``sampling_params.n`` on ``/generate``) expands a batch of B prompts into B x n requests,
prompt-major (request ``k = prompt_index * n + sample_index``, also the choice index). Bootstrap
rooms are SGLang 0.5.23's: ``_normalize_bootstrap_params`` turns a scalar room into ``room + i``
per element, but every sample of prompt ``i`` is a copy of element ``i`` and keeps its room, so in
P/D the samples of one prompt share a room; a room transfers once (``emulator.kvtransfer``), and
the other samples' decodes wait for KV that never comes (sglang PRs #26486, #30723): with
``n > 1`` in P/D, real SGLang 0.5.23 hangs, and so does this. Batches (``n == 1``) pair up.
Sample ``j`` is seeded ``seed + j``: greedy samples are equal, seeded ones differ reproducibly.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from emulator import model, tokenizer
from emulator.stops import StopSpec

FAKE_BOOTSTRAP_HOST = "2.2.2.2"


class Item(msgspec.Struct):
    rid: str
    prompt: list[int]
    max_new: int
    sample_seed: int | None
    room: int | None
    bhost: str | None
    bport: int | None
    logprob: bool = False
    top_n: int = 0
    stop: StopSpec | None = None
    read_cache: bool = True  # False: the prompt's logprobs are asked (logprob_start_len 0)


class Result(msgspec.Struct):
    output_ids: list[int]
    finish: dict[str, Any] | None
    cached_tokens: int
    prompt_tokens: int
    t_received: float
    t_first: float
    error_status: int = 0
    error_message: str = ""
    visible: int | None = None  # stopped: the output tokens whose text is shown

    @property
    def shown_ids(self) -> list[int]:
        """The output tokens whose text the client sees (all but a stop string's)."""
        return self.output_ids if self.visible is None else self.output_ids[: self.visible]

    @property
    def text(self) -> str:
        return tokenizer.decode(self.shown_ids)

    @property
    def matched(self) -> Any:
        return (self.finish or {}).get("matched")

    @property
    def finish_type(self) -> str | None:
        """The OpenAI routes' `finish_reason`: the finish's type."""
        return None if self.finish is None else str(self.finish.get("type"))


def _listify(v: Any, n: int) -> list[Any]:
    if isinstance(v, list):
        return v
    return [v] * n


def _rooms(v: Any, num: int, n: int) -> list[int | None]:
    """SGLang's ``_normalize_bootstrap_params`` for ``num`` = batch x ``n`` requests: a scalar room
    becomes ``room + k`` for the ``k``-th entry, a list is repeated ``n`` times. (Only the first
    batch-size entries are used: sample ``j`` of prompt ``i`` takes entry ``i``.)"""
    if v is None:
        return [None] * num
    if isinstance(v, list):
        return [None if x is None else int(x) for x in v] * n
    return [int(v) + k for k in range(num)]


def _per_sample(v: Any, n: int) -> list[Any]:
    """A per-request field (host, port) after expansion: scalars repeat, lists repeat ``n`` times."""
    return list(v) * n if isinstance(v, list) else [v]


def _of_prompt(value: Any, i: int) -> Any:
    """A field given once for all prompts or as a list with one entry per prompt
    (`return_logprob`, `top_logprobs_num`: GenerateReqInput's per-item forms)."""
    if isinstance(value, list):
        return value[i] if i < len(value) else None
    return value


def _pick(values: list[Any], k: int) -> Any:
    if len(values) == 1:
        return values[0]
    return values[k] if k < len(values) else None


def num_samples(v: Any) -> int:
    n = 1 if v is None else int(v)
    if n < 1:
        raise ValueError("n must be at least 1")
    return n


def per_prompt_params(sp: Any, prompts: int, batch: bool) -> list[dict[str, Any]]:
    """`/generate`'s `sampling_params`, one dict per prompt: an object is every prompt's, a list
    holds one per prompt of a batch (SGLang indexes it by prompt; a list for a single prompt or
    one shorter than the batch fails inside the engine, here with a 400)."""
    if sp is None:
        return [{}] * prompts
    if isinstance(sp, dict):
        return [sp] * prompts
    if not isinstance(sp, list) or not all(isinstance(x, dict) for x in sp):
        raise TypeError("sampling_params must be an object or a list of objects")
    if not batch or len(sp) < prompts:
        raise ValueError(f"sampling_params has {len(sp)} entries for {prompts} prompt(s)")
    return sp[:prompts]


def prompt_refusal(body: dict[str, Any]) -> str | None:
    """``GenerateReqInput.normalize_batch_and_arguments``' refusals of the prompt fields
    (``_validate_inputs``, then ``_determine_batch_size``, managers/io_struct.py): none or all
    three of text, input_ids and input_embeds; an empty input_ids (text, when given, is read
    first: an empty text list is an empty batch)."""
    given = [body.get(k) is not None for k in ("text", "input_ids", "input_embeds")]
    if not any(given) or all(given):
        return "Either text, input_ids or input_embeds should be provided."
    if body.get("text") is None and body.get("input_ids") == []:
        return "input_ids cannot be empty."
    return None


def max_new_of(sp: dict[str, Any]) -> int:
    v = sp.get("max_new_tokens")
    return 128 if v is None else int(v)


def sampling_seed(sp: dict[str, Any]) -> int | None:
    t = sp.get("temperature")
    if t is None or float(t) <= 0.0:
        return None
    seed = sp.get("seed", sp.get("sampling_seed"))
    return int(seed) if seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "big")


def make_items(
    body: dict[str, Any],
    prompts: list[list[int]],
    max_new: int | list[int],
    sample_seed: int | list[int | None] | None,
    n: int = 1,
    stop: StopSpec | list[StopSpec | None] | None = None,
    batch: bool = False,
) -> list[Item]:
    """One item per (prompt, sample), prompt-major: item ``k = prompt_index * n + sample_index``
    (SGLang's parallel-sampling expansion). `max_new` and `sample_seed` are one for all
    prompts or a list with one per prompt (`/generate`'s list of `sampling_params`). Prefill
    and decode get the same body, so they derive the same rooms and per-sample seeds. Every
    sample of prompt ``i`` has room entry ``i``, as on SGLang 0.5.23 (``_handle_batch_request``
    copies ``obj[i]`` for each sample)."""
    num = len(prompts) * n
    rid = body.get("rid")
    if isinstance(rid, str) and batch and n == 1:
        rid = [f"{rid}_{i}" for i in range(num)]  # io_struct.py _normalize_rid: rid_0, rid_1, ...
    rids = _listify(rid, len(prompts)) if rid is not None and n == 1 else [None] * num
    hosts = _per_sample(body.get("bootstrap_host"), n)
    ports = _per_sample(body.get("bootstrap_port"), n)
    rooms = _rooms(body.get("bootstrap_room"), num, n)
    items = []
    for i, p in enumerate(prompts):
        for j in range(n):
            k = i * n + j
            host, port = _pick(hosts, i), _pick(ports, i)
            items.append(
                Item(
                    str(rids[k]) if k < len(rids) and rids[k] is not None else uuid.uuid4().hex,
                    p,
                    max_new[i] if isinstance(max_new, list) else max_new,
                    model.sample_seed(sample_seed[i] if isinstance(sample_seed, list) else sample_seed, j),
                    rooms[i] if i < len(rooms) else None,
                    host,
                    int(port) if port is not None else None,
                    bool(_of_prompt(body.get("return_logprob"), i)),
                    int(_of_prompt(body.get("top_logprobs_num"), i) or 0),
                    stop[i] if isinstance(stop, list) else stop,
                )
            )
    return items
