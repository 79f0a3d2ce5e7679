"""Parse a client request once: a typed view of the fields routing needs; the body stays bytes.

Only the routing fields are decoded (one msgspec pass over `common.fields.Fields`, which ignores
every other key). The prompt is not decoded when it is a string: its size is read off its JSON
text (see `ParsedRequest.prompt_units` and `prompt_peak`, and `common.prompt`).
"""

from __future__ import annotations

import asyncio

import msgspec

from common.bodyscan import scan_body
from common.errors import BadRequest
from common.fields import NULL, Fields, SamplingParams, given
from common.jsonbytes import splice
from common.lax import coerce_openai_fields
from common.prompt import generate_prompt_sizes, measure_prompt, other_ids, prompt_param
from common.workers import CHAT_ROUTE as _CHAT
from common.workers import COMPLETIONS_ROUTE as _COMPLETIONS
from common.workers import GENERATE_ROUTE as _GENERATE
from common.workers import RouteKind

# Accounting defaults when the client gives no limit (engines differ; these only weigh load).
DEFAULT_MAX_TOKENS = {RouteKind.COMPLETIONS: 16, RouteKind.CHAT: 256, RouteKind.GENERATE: 128}


# Lax (msgspec's mode, close to the engines' pydantic lax mode): `"5"` and `5.0` are 5, `"false"`
# and 0 are false; a fractional count or a number for a string field is still refused, by both.
# msgspec takes fewer forms than pydantic (no "yes"/"on", `" 3 "`, `true` for a count): an OpenAI
# body it refuses is read again with those fields as pydantic reads them (`_lax_fields`).
_decoder = msgspec.json.Decoder(Fields, strict=False)
_model_encoder = msgspec.json.Encoder()


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
        "index_id",
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
        "single",
        "stream",
        "usage_unasked",
        "verifiable",
    )

    def __init__(self, route: RouteKind, path: str, body: bytes, f: Fields, model: str) -> None:
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
        null_rid = f.rid == NULL
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
        ) = measure_prompt(route, f)
        # the request's largest token id wherever an engine reads ids (the prompt, a chat's
        # `input_ids`, `stop_token_ids`), and the parameter that holds it, for the vocabulary
        # check against the chosen workers (a negative id is a 400 here already)
        self.id_param = prompt_param(route, f)
        # the largest id an engine reads as an index (the prompt's; stop ids with a minimum
        # length): what the token-id bounds learned where no vocabulary size is known compare
        # (gateway/orchestration/token_bounds.py)
        self.index_id = self.max_id
        sp = f.sampling_params
        if (
            f.stop_token_ids
            or (f.input_ids and route is RouteKind.CHAT)
            or (sp is not None and (sp.__class__ is list or sp.stop_token_ids))  # type: ignore[union-attr]
        ):
            for top, param, indexed in other_ids(route, f):
                if top > self.max_id:
                    self.max_id, self.id_param = top, param
                if indexed and top > self.index_id:
                    self.index_id = top
        self._read_sampling(route, f)
        explicit = self.max_tokens
        self.local_prefill = (
            _local_prefill(route, f, explicit) if f.echo or f.prompt_logprobs or explicit == 0 else None
        )

    def _read_sampling(self, route: RouteKind, f: Fields) -> None:
        """What the request asks of sampling: `max_tokens` as given (None where none is), `n`,
        `greedy`, `same_first_token` and, for a `/generate` batch with a budget per prompt,
        `prompt_pairs`."""
        sp = f.sampling_params
        # `/generate` batches with a budget per prompt: (prompt size, its max_new_tokens) each,
        # for the length preflight; None otherwise (the largest prompt with `max_tokens`)
        self.prompt_pairs: tuple[tuple[int, int], ...] | None = None
        if route is not _GENERATE:
            explicit = f.max_tokens
            # chat's newer name wins; the legacy completions route has none (the engines ignore
            # it). A 0 falls through to max_tokens, as SGLang reads it (`max_completion_tokens or
            # max_tokens`); vLLM refuses that 0 itself (its adapter, before a P/D prefill).
            if route is _CHAT and f.max_completion_tokens:
                explicit = f.max_completion_tokens
            n = 1 if f.n is None else f.n
            greedy = f.temperature == 0 or f.top_k == 1
            seeded = given(f.seed)
        elif isinstance(sp, list):
            explicit, n, greedy = _per_prompt(sp, self.batch, self.is_batch)
            seeded = False  # a batch: its first tokens are not compared
            if explicit is not None:  # each prompt must fit with its own budget, not the largest
                budgets = [0 if x.max_new_tokens is None else x.max_new_tokens for x in sp]
                self.prompt_pairs = tuple(zip(generate_prompt_sizes(f), budgets, strict=True))
        else:
            explicit = sp.max_new_tokens if sp else None
            n = 1 if sp is None or sp.n is None else sp.n
            greedy = sp is not None and (sp.temperature == 0 or sp.top_k == 1)
            seeded = sp is not None and given(sp.sampling_seed)
        self.max_tokens: int | None = explicit
        self.n = n
        self.greedy = greedy
        # one answer to compare (one sample of one prompt): what the decode-consistency guard
        # watches (where it is on); asked several times per request, so answered once here
        single = n == 1 and not self.is_batch
        self.single = single
        # can the answer be checked against a short colocated re-run before its clean end is
        # sent? (greedy, one answer; a stream's tokens flow meanwhile, only its end is held)
        self.verifiable = greedy and single
        # a stream on an OpenAI route that did not ask for usage: where the guard is on, its
        # decode is asked for a usage chunk (`HandoffCtx.stream_usage`), dropped on the way out:
        # the guard's "finished early" check needs the real token count, and counting events is
        # wrong both ways (role-only events; SGLang sends several tokens in one event with
        # --stream-interval > 1 or a held-back multi-byte character)
        self.usage_unasked = self.stream and not self.include_usage and route is not _GENERATE and single
        # must the decode start on the prefill's first token? Greedy requests, and one sample of
        # one prompt drawn with a seed: both legs draw the first token from the same logits with
        # the same seed (vLLM's decode samples it again; SGLang's is the prefill's, shipped)
        self.same_first_token = greedy or (seeded and single)

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


def _decode_fields(route: RouteKind, body: bytes) -> Fields:
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
    f: Fields,
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
    if f.text == NULL:  # (a client serialising SGLang's GenerateReqInput sends the unused one as null)
        f.text = msgspec.Raw()
    if f.input_ids == NULL:
        f.input_ids = msgspec.Raw()
    if route is _CHAT and not given(f.messages):
        raise BadRequest("missing required parameter: 'messages'", param="messages")
    if route is _COMPLETIONS and not given(f.prompt):
        raise BadRequest("missing required parameter: 'prompt'", param="prompt")
    if route is _GENERATE and not f.text and not f.input_ids:
        raise BadRequest("either 'text' or 'input_ids' is required", param="text")
    try:
        req = ParsedRequest(route, path, body, f, model)
    except (msgspec.DecodeError, UnicodeError) as e:  # e.g. invalid UTF-8 or a lone surrogate
        raise BadRequest(f"invalid prompt: {e}", param=prompt_param(route, f)) from None
    if req.max_tokens is not None:
        # the field the client gave the budget in (chat's newer name where it was given)
        name = "max_tokens"
        if route is _CHAT and f.max_completion_tokens:
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
        param = prompt_param(req.route, req.fields) if req.is_batch else "n"
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
            else prompt_param(req.route, req.fields),
        )


def _lax_fields(route: RouteKind, body: bytes, error: msgspec.ValidationError) -> Fields:
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


def _local_prefill(route: RouteKind, f: Fields, max_tokens: int | None) -> LocalPrefill | None:
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


def _per_prompt(sps: list[SamplingParams], batch: int, is_batch: bool) -> tuple[int | None, int, bool]:
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


def _param_of(msg: str) -> str | None:
    # msgspec says "... - at `$.max_tokens`"
    at = msg.rfind("$.")
    if at < 0:
        return None
    return msg[at + 2 :].rstrip("`").split("[")[0].split(".")[0] or None
