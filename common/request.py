"""Parse a client request once: a typed view of the fields routing needs; the body stays bytes.

Only the routing fields are decoded (one msgspec pass over a Struct that ignores every other
key). The prompt is not decoded when it is a string: its size is read off its JSON text (see
`ParsedRequest.prompt_units` and `prompt_peak`, and `_utf8_floor`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from common.bodyscan import scan_body
from common.errors import BadRequest
from common.jsonbytes import splice
from common.lax import coerce_openai_fields
from common.workers import RouteKind

# Accounting defaults when the client gives no limit (engines differ; these only weigh load).
DEFAULT_MAX_TOKENS = {RouteKind.COMPLETIONS: 16, RouteKind.CHAT: 256, RouteKind.GENERATE: 128}


class _SamplingParams(msgspec.Struct):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    n: int | None = None
    sampling_seed: msgspec.Raw = msgspec.Raw()  # empty: absent
    stop_token_ids: msgspec.Raw = msgspec.Raw()  # empty: absent (token ids: checked like a prompt's)


class _Message(msgspec.Struct):
    """A chat message as far as the gateway checks it (the engines check the rest)."""

    role: str
    content: msgspec.Raw = msgspec.Raw()  # a string, a list of parts, or null


class _Part(msgspec.Struct):
    """A chat content part; only text parts are measured (an image's, audio's or file's tokens
    are the model's business: its base64 text is never tokenized)."""

    type: Any = None
    text: msgspec.Raw = msgspec.Raw()


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Fields(msgspec.Struct):
    """The keys the gateway reads. Unknown keys are ignored here and passed through untouched."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    seed: msgspec.Raw = msgspec.Raw()  # empty: absent
    stream_options: _StreamOptions | None = None
    # prompts, kept raw
    prompt: msgspec.Raw = msgspec.Raw()  # empty: absent
    messages: msgspec.Raw = msgspec.Raw()  # empty: absent
    text: msgspec.Raw = msgspec.Raw()  # empty: absent
    input_ids: msgspec.Raw = msgspec.Raw()  # empty: absent
    tools: msgspec.Raw = msgspec.Raw()  # empty: absent (a chat's tools: part of its prompt's key)
    sampling_params: _SamplingParams | list[_SamplingParams] | None = None  # a list: one per prompt
    return_logprob: bool | list[bool] | None = None  # a list: one per prompt (/generate batches)
    logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent
    echo: bool | None = None
    prompt_logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent (vLLM's extension)
    top_logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent
    rid: msgspec.Raw = msgspec.Raw()  # empty: absent
    stop_token_ids: msgspec.Raw = msgspec.Raw()  # empty: absent (token ids: checked like a prompt's)
    user: str | None = None
    session_id: Any = None  # not an engine field: a routing hint when a string or an integer
    # fields the gateway owns on the way to engines; a client must not smuggle them in
    bootstrap_host: msgspec.Raw = msgspec.Raw()  # empty: absent
    bootstrap_port: msgspec.Raw = msgspec.Raw()  # empty: absent
    bootstrap_room: msgspec.Raw = msgspec.Raw()  # empty: absent
    kv_transfer_params: msgspec.Raw = msgspec.Raw()  # empty: absent


# Lax (msgspec's mode, close to the engines' pydantic lax mode): `"5"` and `5.0` are 5, `"false"`
# and 0 are false; a fractional count or a number for a string field is still refused, by both.
# msgspec takes fewer forms than pydantic (no "yes"/"on", `" 3 "`, `true` for a count): an OpenAI
# body it refuses is read again with those fields as pydantic reads them (`_lax_fields`).
_decoder = msgspec.json.Decoder(_Fields, strict=False)
# strict, the usual spellings at C speed; a completions prompt that fails them is read again as
# pydantic's lax mode would (_lax_token_ids); /generate's input_ids are strict in SGLang too
_any_decoder = msgspec.json.Decoder()
_ids_decoder = msgspec.json.Decoder(list[int])
_id_lists_decoder = msgspec.json.Decoder(list[list[int]])
_texts_decoder = msgspec.json.Decoder(list[str])
_messages_decoder = msgspec.json.Decoder(list[_Message])
_parts_decoder = msgspec.json.Decoder(list[_Part])
_model_encoder = msgspec.json.Encoder()
_NULL = msgspec.Raw(b"null")


class ParsedRequest:
    """A client request after parsing. `body` is the client's bytes, untouched (but for the
    served model's name where the client named none)."""

    __slots__ = (
        "batch",
        "body",
        "engine_rids",
        "fields",
        "greedy",
        "has_owned_fields",
        "id_param",
        "include_usage",
        "is_batch",
        "local_prefill",
        "max_id",
        "max_tokens",
        "model",
        "n",
        "path",
        "prompt_is_ids",
        "prompt_pairs",
        "prompt_peak",
        "prompt_units",
        "return_logprob",
        "route",
        "same_first_token",
        "stream",
    )

    def __init__(self, route: RouteKind, path: str, body: bytes, f: _Fields, model: str) -> None:
        self.route = route
        self.path = path
        self.body = body
        self.fields = f
        self.model = model
        # the names an adapter gave this request's upstream requests (SGLang's rids), to abort them by
        self.engine_rids: dict[str, tuple[int, bytes] | str] | None = None
        self.stream = bool(f.stream)
        self.include_usage = bool(f.stream_options and f.stream_options.include_usage)
        rl = f.return_logprob
        self.return_logprob = any(rl) if isinstance(rl, list) else bool(rl)
        null_rid = f.rid == _NULL
        if null_rid:  # `"rid": null` is SGLang's "no name": the gateway names it, as if absent
            f.rid = msgspec.Raw()
        self.has_owned_fields = (  # (a null rid: dropped from the body, the gateway's rid put in)
            null_rid
            or bool(f.bootstrap_host)
            or bool(f.bootstrap_port)
            or bool(f.bootstrap_room)
            or bool(f.kv_transfer_params)
        )
        (
            self.batch,
            self.is_batch,
            self.prompt_units,
            self.prompt_peak,
            self.prompt_is_ids,
            self.max_id,
        ) = _measure_prompt(route, f)
        # the request's largest token id wherever an engine reads ids (the prompt, a chat's
        # `input_ids`, `stop_token_ids`), and the parameter that holds it, for the vocabulary
        # check against the chosen workers (a negative id is a 400 here already)
        self.id_param = _prompt_param(route, f)
        sp = f.sampling_params
        if (
            f.stop_token_ids
            or (f.input_ids and route is RouteKind.CHAT)
            or (sp is not None and (sp.__class__ is list or sp.stop_token_ids))  # type: ignore[union-attr]
        ):
            for top, param in _other_ids(route, f):
                if top > self.max_id:
                    self.max_id, self.id_param = top, param
        pairs: tuple[tuple[int, int], ...] | None = None
        if route is not RouteKind.GENERATE:
            explicit = f.max_tokens
            # chat's newer name wins; the legacy completions route has none (the engines ignore
            # it). A 0 falls through to max_tokens, as SGLang reads it (`max_completion_tokens or
            # max_tokens`); vLLM refuses that 0 itself (its adapter, before a P/D prefill).
            if route is RouteKind.CHAT and f.max_completion_tokens:
                explicit = f.max_completion_tokens
            n = 1 if f.n is None else f.n
            greedy = f.temperature == 0 or f.top_k == 1
            seeded = given(f.seed)
        elif isinstance(sp, list):
            explicit, n, greedy = _per_prompt(sp, self.batch, self.is_batch)
            seeded = False  # a batch: its first tokens are not compared
            if explicit is not None:  # each prompt must fit with its own budget, not the largest
                budgets = [0 if x.max_new_tokens is None else x.max_new_tokens for x in sp]
                pairs = tuple(zip(_generate_prompt_sizes(f), budgets, strict=True))
        else:
            explicit = sp.max_new_tokens if sp else None
            n = 1 if sp is None or sp.n is None else sp.n
            greedy = sp is not None and (sp.temperature == 0 or sp.top_k == 1)
            seeded = sp is not None and given(sp.sampling_seed)
        self.max_tokens: int | None = explicit
        # `/generate` batches with a budget per prompt: (prompt size, its max_new_tokens) each,
        # for the length preflight; None otherwise (the largest prompt with `max_tokens`)
        self.prompt_pairs = pairs
        self.n = n
        self.greedy = greedy
        # must the decode start on the prefill's first token? Greedy requests, and one sample of
        # one prompt drawn with a seed: both legs draw the first token from the same logits with
        # the same seed (vLLM's decode samples it again; SGLang's is the prefill's, shipped)
        self.same_first_token = greedy or (seeded and n == 1 and not self.is_batch)
        self.local_prefill = (
            _local_prefill(route, f, explicit) if f.echo or f.prompt_logprobs or explicit == 0 else None
        )

    @property
    def units(self) -> int:
        """Prompts times samples: the single-prompt, single-sample requests it holds."""
        return self.batch * self.n if self.is_batch else self.n

    @property
    def accounting_max_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS[self.route]

    def decode_dict(self) -> dict[str, msgspec.Raw]:
        """The body as {key: raw value}, for adapters that rewrite keys (values stay bytes)."""
        out: dict[str, msgspec.Raw] = msgspec.json.decode(self.body, type=dict[str, msgspec.Raw])
        return out


class WorkLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one request may ask of the gateway and its engines: `[limits]` (the defaults are
    `gateway.config.LimitsConfig`'s, the one source)."""

    max_batch: int  # completions asked for: prompts x n
    max_request_tokens: int  # prompt tokens + prompts x n x max_tokens
    max_json_values: int  # JSON values in the body (bounds its decoding)
    chars_per_token: float  # a text prompt's token estimate (guards.chars_per_token_estimate)


def parse_request(
    route: RouteKind,
    path: str,
    body: bytes,
    *,
    default_model: str | None,
    max_n: int,
    max_tokens_cap: int | None,
    work: WorkLimits | None = None,
) -> ParsedRequest:
    """Parse a client request; BadRequest (a 400, 413 past `work.max_json_values`) says what is
    wrong. A body larger than `bodyscan.SCAN_FROM` should go through `parse_large_request`,
    which keeps the event loop free while it is measured."""
    if not body or body.isspace():  # (stops at the first byte that is not a space: no copy)
        raise BadRequest("request body is empty; expected a JSON object")
    if not body.isascii():  # (fast for the usual ASCII body) JSON is UTF-8: check it once here,
        try:  # so no later decode of a raw field (prompt, rid...) meets invalid bytes
            body.decode()
        except UnicodeDecodeError as e:
            raise BadRequest(f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    f = _decode_fields(route, body)
    return _build(route, path, body, f, default_model, max_n, max_tokens_cap, work)


async def parse_large_request(
    route: RouteKind,
    path: str,
    body: bytes,
    *,
    default_model: str | None,
    max_n: int,
    max_tokens_cap: int | None,
    work: WorkLimits,
) -> ParsedRequest:
    """`parse_request` for a large body, in slices: its UTF-8 and JSON values are checked
    window by window first (`bodyscan.scan_body`: a 413 past `work.max_json_values` before any
    decode), then it is decoded (a time that limit bounds), the event loop let run between."""
    if not body or body.isspace():  # (stops at the first byte that is not a space: no copy)
        raise BadRequest("request body is empty; expected a JSON object")
    await scan_body(body, work.max_json_values)
    f = _decode_fields(route, body)
    await asyncio.sleep(0)
    return _build(route, path, body, f, default_model, max_n, max_tokens_cap, work)


def _decode_fields(route: RouteKind, body: bytes) -> _Fields:
    try:
        f = _decoder.decode(body)
    except msgspec.ValidationError as e:
        f = _lax_fields(route, body, e)
    except msgspec.DecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}", code=None) from None
    except RecursionError:  # msgspec's decoder recurses once per level of nesting
        raise BadRequest("request body is nested too deeply to be decoded", code=None) from None
    return f


def _build(
    route: RouteKind,
    path: str,
    body: bytes,
    f: _Fields,
    default_model: str | None,
    max_n: int,
    max_tokens_cap: int | None,
    work: WorkLimits | None,
) -> ParsedRequest:
    model = f.model
    if not model:
        # as the engines do (vLLM: its served model; SGLang: "default"), where one model is served
        if default_model is None:
            raise BadRequest(
                "missing required parameter: 'model' (more than one model is served)", param="model"
            )
        model = default_model
        if route is not RouteKind.GENERATE:  # (SGLang's /generate takes no `model` field)
            body = splice(body, b'"model":' + _model_encoder.encode(model))
    if f.text == _NULL:  # (a client serialising SGLang's GenerateReqInput sends the unused one as null)
        f.text = msgspec.Raw()
    if f.input_ids == _NULL:
        f.input_ids = msgspec.Raw()
    if route is RouteKind.CHAT and not given(f.messages):
        raise BadRequest("missing required parameter: 'messages'", param="messages")
    if route is RouteKind.COMPLETIONS and not given(f.prompt):
        raise BadRequest("missing required parameter: 'prompt'", param="prompt")
    if route is RouteKind.GENERATE and not f.text and not f.input_ids:
        raise BadRequest("either 'text' or 'input_ids' is required", param="text")
    try:
        req = ParsedRequest(route, path, body, f, model)
    except (msgspec.DecodeError, UnicodeError) as e:  # e.g. invalid UTF-8 or a lone surrogate
        raise BadRequest(f"invalid prompt: {e}", param=_prompt_param(route, f)) from None
    if req.max_tokens is not None:
        # the field the client gave the budget in (chat's newer name where it was given)
        name = "max_tokens"
        if route is RouteKind.CHAT and f.max_completion_tokens:
            name = "max_completion_tokens"
        if req.max_tokens < 1 and route is not RouteKind.GENERATE:
            # a chat's 0 is the prompt alone on SGLang, the engine's own 400 on vLLM
            if not (req.max_tokens == 0 and (f.echo or route is RouteKind.CHAT)):
                why = "" if route is RouteKind.CHAT else " (0 only with 'echo': the prompt alone)"
                raise BadRequest(f"'{name}' must be at least 1{why}", param=name)
        if max_tokens_cap is not None and req.max_tokens > max_tokens_cap:
            raise BadRequest(f"'{name}' must be at most {max_tokens_cap}", param=name)
    if not 1 <= req.n <= max_n:
        raise BadRequest(f"'n' must be between 1 and {max_n}", param="n")
    if work is not None:
        _check_work(req, work)
    return req


def _check_work(req: ParsedRequest, work: WorkLimits) -> None:
    """The request's size against `work`: the completions it asks for (each prompt of a batch
    times `n`: on SGLang P/D each is a handoff of its own) and the tokens (its prompts, as
    token ids or the text's estimate, and `max_tokens` for each of those completions; the
    route's accounting default where none is given) of a request of several completions; one
    alone is bounded by the context length of the workers it goes to."""
    units = req.batch * req.n
    if units > work.max_batch:
        param = _prompt_param(req.route, req.fields) if req.is_batch else "n"
        raise BadRequest(
            f"the request asks for {units} completions ({req.batch} prompt(s) x n={req.n}); at most "
            f"{work.max_batch} are served per request (limits.max_batch)",
            param=param,
        )
    if units == 1:
        return  # one completion: the workers' context length bounds it (the length preflight's 400)
    # (a chat's text only: its images' base64 is no measure of its tokens)
    size = req.prompt_peak if req.route is RouteKind.CHAT else req.prompt_units
    prompt = size if req.prompt_is_ids else int(size / work.chars_per_token) + 1
    tokens = prompt + req.accounting_max_tokens * units
    if tokens > work.max_request_tokens:
        name = "max_new_tokens" if req.route is RouteKind.GENERATE else "max_tokens"
        raise BadRequest(
            f"the request asks for about {tokens} tokens (its prompts, and {name} for each of its "
            f"{units} completion(s)); at most {work.max_request_tokens} are served per request "
            "(limits.max_request_tokens)",
            param=name
            if req.accounting_max_tokens * units >= prompt
            else _prompt_param(req.route, req.fields),
        )


def _lax_fields(route: RouteKind, body: bytes, error: msgspec.ValidationError) -> _Fields:
    """The slow path of a body the fast decode refused: on the OpenAI routes, whose engines read
    requests with pydantic's lax mode, its scalar fields are read as pydantic reads them
    (`"stream": "yes"`, `"max_tokens": " 3 "`) and it is decoded again; what pydantic refuses
    too is the same 400 as before. `/generate` (SGLang's dataclass, no pydantic) is not retried."""
    if route is not RouteKind.GENERATE:
        coerced = coerce_openai_fields(body)
        if coerced is not None:
            try:
                return _decoder.decode(coerced)
            except msgspec.ValidationError as e:  # another field, or one pydantic refuses too
                error = e
            except RecursionError:  # (the first decode stopped before the nesting; the 400 is its)
                pass
    raise BadRequest(f"invalid request: {error}", param=_param_of(str(error))) from None


def given(raw: msgspec.Raw | None) -> bool:
    """Is a raw JSON field's value set: present and neither null nor false?"""
    return raw is not None and bool(raw) and bytes(raw) not in (b"null", b"false")


class LocalPrefill(msgspec.Struct, frozen=True):
    """Why an answer needs the prompt computed by the engine that answers it."""

    param: str  # the request parameter that asks for it
    why: str
    # every engine answers it with the prompt's logprobs (echo with logprobs > 0), so a decode
    # that cannot compute the prompt itself (SGLang's) would answer without them; otherwise only
    # vLLM acts on it (its decode would compute the prompt again: `logprobs` 0 with echo,
    # `prompt_logprobs`, `max_tokens` 0) and SGLang ignores or refuses it by itself
    all_engines: bool = False


_ECHO_LOGPROBS = LocalPrefill("echo", "'echo' with 'logprobs' asks for the prompt's logprobs", True)
_ECHO_LOGPROBS_0 = LocalPrefill("echo", "'echo' with 'logprobs' 0 asks vLLM for the prompt's logprobs")
_PROMPT_LOGPROBS = LocalPrefill("prompt_logprobs", "'prompt_logprobs' asks for the prompt's logprobs")
_PROMPT_ONLY = LocalPrefill("max_tokens", "'max_tokens' 0 asks for the prompt alone")
# vLLM's chat takes `echo` as prompt_logprobs = top_logprobs (0 by default: not None), so its
# decode computes the prompt again (chat_completion/protocol.py:742-744)
_CHAT_ECHO = LocalPrefill("echo", "'echo' on a chat asks vLLM for the prompt's logprobs")


def _local_prefill(route: RouteKind, f: _Fields, max_tokens: int | None) -> LocalPrefill | None:
    """Does the answer need the prompt computed by the engine that answers (so that a P/D
    decode, which is handed the prompt's KV instead, may lack it)? None for most requests. On
    `/generate` the prefill's prompt logprobs are merged into the decode's answer instead."""
    if route is RouteKind.GENERATE:
        return None
    if f.echo and route is RouteKind.CHAT and bytes(f.top_logprobs) != b"null":
        return _CHAT_ECHO
    if f.echo and given(f.logprobs) and route is RouteKind.COMPLETIONS:
        return _ECHO_LOGPROBS_0 if _is_zero(bytes(f.logprobs)) else _ECHO_LOGPROBS
    if given(f.prompt_logprobs):
        return _PROMPT_LOGPROBS
    if max_tokens == 0:
        return _PROMPT_ONLY
    return None


def _is_zero(raw: bytes) -> bool:
    """A count the engines read as 0 (pydantic's lax int: `0`, `0.0`, `-0`, `0e0`, `"0"`)."""
    try:
        v = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return False
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            return False
    return isinstance(v, int | float) and not isinstance(v, bool) and v == 0


def _per_prompt(sps: list[_SamplingParams], batch: int, is_batch: bool) -> tuple[int | None, int, bool]:
    """`/generate` with one `sampling_params` object per prompt of a batch (SGLang's list form):
    (the largest `max_new_tokens` given, None when no entry gives one; `n`, which
    SGLang requires to be the same in every entry; greedy when every entry is)."""
    if not is_batch:
        raise BadRequest(
            "'sampling_params' is a list, which needs a batch of prompts; use an object for one prompt",
            param="sampling_params",
        )
    if len(sps) != batch:
        raise BadRequest(
            f"'sampling_params' has {len(sps)} entries for a batch of {batch} prompts; "
            "give one per prompt, or one object for all",
            param="sampling_params",
        )
    ns = {1 if sp.n is None else sp.n for sp in sps}
    if len(ns) > 1:
        raise BadRequest("'n' must be the same in every entry of 'sampling_params'", param="sampling_params")
    explicit = max((sp.max_new_tokens for sp in sps if sp.max_new_tokens is not None), default=None)
    greedy = all(sp.temperature == 0 or sp.top_k == 1 for sp in sps)
    return explicit, ns.pop(), greedy


def _generate_prompt_sizes(f: _Fields) -> list[int]:
    """Each prompt's size in a `/generate` batch, measured as `_measure_prompt` measures it (UTF-8
    bytes of a text, the count of token ids); only read for per-prompt budgets, after
    `_measure_prompt` has checked the shape."""
    if f.input_ids:  # (SGLang reads them when both are given)
        return [len(x) for x in _id_lists_decoder.decode(bytes(f.input_ids))]
    return [len(x.encode()) for x in _texts_decoder.decode(bytes(f.text))]


def _id_range(ids: list[int], param: str, raw: bytes | None = None) -> int:
    """The largest id of a token-id prompt; a negative id is a 400. `raw`: the ids' JSON,
    when they were read from it as plain integers (no `-` in it: none is negative, and the
    pass for the smallest is saved)."""
    if (raw is None or b"-" in raw) and min(ids) < 0:
        raise BadRequest(f"Token id {min(ids)} is out of vocabulary", param=param)
    return max(ids)


def _prompt_param(route: RouteKind, f: _Fields) -> str:
    if route is RouteKind.GENERATE:
        return "input_ids" if f.input_ids else "text"
    return "messages" if route is RouteKind.CHAT else "prompt"


def _param_of(msg: str) -> str | None:
    # msgspec says "... - at `$.max_tokens`"
    at = msg.rfind("$.")
    if at < 0:
        return None
    return msg[at + 2 :].rstrip("`").split("[")[0].split(".")[0] or None


def _measure_prompt(route: RouteKind, f: _Fields) -> tuple[int, bool, int, int, bool, int]:
    """(batch size, is a batch, prompt size summed over the batch, the largest prompt's size,
    size is in token ids, the largest token id or -1). The sum is the load a request brings; the
    largest prompt is what must fit a context (the engines check each prompt of a batch alone).

    For text the size is an upper bound of its UTF-8 bytes (the JSON length, escapes included);
    for token ids it is their exact count. The prompt's shape is checked as the engines' schemas
    check it (a string, a list of strings, token ids, or lists of them; `/generate`'s `text` the
    string forms, its `input_ids` the id forms; chat messages objects with a role), every item,
    not only the first: a shape an engine refuses is the client's 400 here, never a worker's
    fault. A negative token id is refused here; one too large for a worker's vocabulary where
    the worker's vocabulary size is known (the orchestrator)."""
    if route is RouteKind.CHAT:
        data = bytes(f.messages)
        try:
            messages = _messages_decoder.decode(data)
        except msgspec.ValidationError as e:
            raise BadRequest(
                f"'messages' must be an array of message objects, each with a 'role': {e}", param="messages"
            ) from None
        if not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
        # the load estimate stays the JSON's length (an upper bound, images included); what must
        # fit a context is the text's floor
        return 1, False, len(data), sum(_content_floor(bytes(m.content)) for m in messages), False, -1
    if route is RouteKind.COMPLETIONS:
        raw, param, texts, ids = f.prompt, "prompt", True, True
    elif f.input_ids:
        # SGLang reads `input_ids` whenever they are given, `text` beside them or not
        # (tokenizer_manager.py `_tokenize_one_request`), and takes the batch's size from `text`
        # (io_struct.py `_determine_batch_size`): the two must agree, else SGLang would pair
        # prompt i's text with another prompt's ids
        if f.text:
            _same_batch(bytes(f.text), bytes(f.input_ids))
        raw, param, texts, ids = f.input_ids, "input_ids", False, True
    else:
        raw, param, texts, ids = f.text, "text", True, False
    data = bytes(raw).strip()
    head = data[:1]
    if head == b'"' and texts:
        return 1, False, len(data), _utf8_floor(data), False, -1
    item = data[1:].lstrip()[:1]  # the first item's first byte
    if head != b"[" or (item == b'"' and not texts) or (item != b'"' and not ids):
        raise BadRequest(_shape_message(param, texts, ids), param=param)
    if item == b"]":
        raise BadRequest("the prompt must not be empty", param=param)
    try:
        if item == b'"':
            strings = _texts_decoder.decode(data)
            sizes = [len(x.encode()) for x in strings]
            return len(strings), True, sum(sizes), max(sizes), False, -1
        if item == b"[":
            lists = _id_lists_decoder.decode(data)
            _no_empty(lists, param)
            top = max((_id_range(x, param, data) for x in lists if x), default=-1)
            return len(lists), True, sum(len(x) for x in lists), max(len(x) for x in lists), True, top
        one = _ids_decoder.decode(data)
        return 1, False, len(one), len(one), True, _id_range(one, param, data)
    except msgspec.ValidationError as e:
        if route is RouteKind.COMPLETIONS:
            lax = _lax_token_ids(_any_decoder.decode(data))
            if lax is not None:
                return lax
        raise BadRequest(f"{_shape_message(param, texts, ids)} ({e})", param=param) from None


def _same_batch(text: bytes, input_ids: bytes) -> None:
    """`/generate` with both `text` and `input_ids`: one prompt each, or batches of one size."""
    text_batch = text.lstrip()[:1] == b"["
    ids = input_ids.strip()
    ids_batch = ids[1:].lstrip()[:1] == b"["
    sizes_differ = False
    if text_batch and ids_batch:
        try:
            sizes_differ = len(_texts_decoder.decode(text)) != len(_any_decoder.decode(ids))
        except msgspec.ValidationError:
            return  # a wrong shape: the prompt's own check says which
    if text_batch != ids_batch or sizes_differ:
        raise BadRequest(
            "'text' and 'input_ids' are both given and are not one prompt each or batches of the "
            "same size; SGLang reads 'input_ids' (give only one of them)",
            param="input_ids",
        )


def _other_ids(route: RouteKind, f: _Fields) -> list[tuple[int, str]]:
    """(largest id, parameter) of the token ids an engine reads besides the prompt: SGLang's
    chat `input_ids` (its prompt when given: the template is skipped, serving_chat.py:1947),
    and `stop_token_ids` (top level, or in `/generate`'s `sampling_params`, one object or a
    list): with a minimum length, SGLang 0.5.23 scatters them into a vocabulary-wide tensor
    (penaltylib/min_new_tokens.py) and its scheduler dies on one outside the vocabulary; vLLM
    refuses those itself. Negative ids and shapes no engine reads as ids are a 400."""
    out: list[tuple[int, str]] = []
    if route is RouteKind.CHAT and given(f.input_ids):
        out.append((_lax_id_list(bytes(f.input_ids), "input_ids", empty_ok=False), "input_ids"))
    if given(f.stop_token_ids):
        out.append((_lax_id_list(bytes(f.stop_token_ids), "stop_token_ids"), "stop_token_ids"))
    sp = f.sampling_params
    for x in sp if isinstance(sp, list) else (sp,) if sp is not None else ():
        if given(x.stop_token_ids):
            out.append((_lax_id_list(bytes(x.stop_token_ids), "stop_token_ids"), "stop_token_ids"))
    return out


def _lax_id_list(raw: bytes, param: str, *, empty_ok: bool = True) -> int:
    """The largest id of a list of token ids read as pydantic's lax mode reads a `list[int]`
    (`5`, `5.0`, `"5"`, `true`), -1 when empty; a 400 for a negative id or anything else."""
    try:
        ids = _ids_decoder.decode(raw)
    except msgspec.ValidationError:
        value = _any_decoder.decode(raw)
        lax = _lax_ids(value) if isinstance(value, list) else None
        if lax is None:
            raise BadRequest(f"'{param}' must be a list of token ids", param=param) from None
        ids = lax
    if not ids:
        if not empty_ok:
            raise BadRequest(f"'{param}' must not be empty", param=param)
        return -1
    return _id_range(ids, param)


def _lax_ids(items: list[Any]) -> list[int] | None:
    """Token ids as pydantic's lax `int` reads them (`true` is 1, `2.0` is 2, `"7"` is 7), or
    None if one is no integer in any of those forms."""
    out: list[int] = []
    for x in items:
        if isinstance(x, int):  # (bool too)
            out.append(int(x))
        elif isinstance(x, float) and x.is_integer():
            out.append(int(x))
        elif isinstance(x, str) and x.strip().lstrip("+-").isdecimal():
            try:
                out.append(int(x))
            except ValueError:
                return None
        else:
            return None
    return out


def _lax_token_ids(value: list[Any]) -> tuple[int, bool, int, int, bool, int] | None:
    """A completions prompt list read as both engines' schemas read it where it is not plain
    JSON integers: pydantic's lax mode takes `true` as 1, `2.0` as 2 and `"7"` as 7 for a token
    id (a list of strings that are not all numbers stays text, which the strict decode took).
    None when it is no token-id prompt either. The engine gets the client's bytes as sent."""

    ids = _lax_ids

    if value and all(isinstance(x, list) for x in value):
        lists = [ids(x) for x in value]
        if any(x is None for x in lists):
            return None
        ok = [x for x in lists if x is not None]
        _no_empty(ok, "prompt")
        top = max((_id_range(x, "prompt") for x in ok if x), default=-1)
        return len(ok), True, sum(len(x) for x in ok), max(len(x) for x in ok), True, top
    one = ids(value)
    if one is None:
        return None
    return 1, False, len(one), len(one), True, _id_range(one, "prompt")


def _utf8_floor(raw: bytes) -> int:
    """A lower bound of the UTF-8 length of the JSON string `raw` (quotes included), read off its
    text without decoding it: each escape is at least one byte shorter (`\\n`: 2 -> 1) and a
    `\\uXXXX` at least five (6 -> 1..3; a surrogate pair 12 -> 4). Exact for a string without
    escapes; never more than the truth, so a length check built on it refuses only what surely
    cannot fit (clients that escape all non-ASCII, as Python's json does, included)."""
    if b"\\" not in raw:
        return max(0, len(raw) - 2)
    return max(0, len(raw) - 2 - raw.count(b"\\") - 4 * raw.count(b"\\u"))


def _content_floor(raw: bytes) -> int:
    """The UTF-8 floor of a chat message's text: a string content, or its text parts."""
    head = raw[:1]
    if head == b'"':
        return _utf8_floor(raw)
    if head != b"[":
        return 0
    try:
        parts = _parts_decoder.decode(raw)
    except msgspec.ValidationError:
        return 0  # a shape the engine judges; nothing is assumed of its size
    return sum(_utf8_floor(bytes(p.text)) for p in parts if p.type == "text" and bytes(p.text)[:1] == b'"')


def _no_empty(lists: list[list[int]], param: str) -> None:
    """A batch of token-id prompts with an empty one: both engines refuse it (vLLM: "The decoder
    prompt cannot be empty"), wherever the gateway sends it."""
    for i, x in enumerate(lists):
        if not x:
            raise BadRequest(f"prompt {i} of the batch is empty", param=param)


def _shape_message(param: str, texts: bool, ids: bool) -> str:
    forms = (["a string", "a list of strings"] if texts else []) + (
        ["a list of token ids", "a list of such lists"] if ids else []
    )
    return f"'{param}' must be {', '.join(forms[:-1])} or {forms[-1]}"
