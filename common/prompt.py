"""A request's prompt measured and its shape checked, without decoding a string prompt.

The size of a text prompt is read off its JSON text (an upper bound of its UTF-8 bytes for the
load, a lower bound where it must fit a context: `_utf8_floor`); token-id prompts are counted
and their ids range-checked. Shapes are checked as the engines' schemas check them, every item:
a shape an engine refuses is the client's 400 here, never a worker's fault."""

from __future__ import annotations

from typing import Any

import msgspec

from common.errors import BadRequest
from common.fields import Fields, given
from common.workers import CHAT_ROUTE as _CHAT
from common.workers import COMPLETIONS_ROUTE as _COMPLETIONS
from common.workers import GENERATE_ROUTE as _GENERATE
from common.workers import RouteKind


class _Message(msgspec.Struct):
    """A chat message as far as the gateway checks it (the engines check the rest)."""

    role: str
    content: msgspec.Raw = msgspec.Raw()  # a string, a list of parts, or null


class _Part(msgspec.Struct):
    """A chat content part; only text parts are measured (an image's, audio's or file's tokens
    are the model's business: its base64 text is never tokenized)."""

    type: Any = None
    text: msgspec.Raw = msgspec.Raw()


# strict, the usual spellings at C speed; a completions prompt that fails them is read again as
# pydantic's lax mode would (_lax_token_ids); /generate's input_ids are strict in SGLang too
_any_decoder = msgspec.json.Decoder()
_ids_decoder = msgspec.json.Decoder(list[int])
_id_lists_decoder = msgspec.json.Decoder(list[list[int]])
_texts_decoder = msgspec.json.Decoder(list[str])
_messages_decoder = msgspec.json.Decoder(list[_Message])
_parts_decoder = msgspec.json.Decoder(list[_Part])


def generate_prompt_sizes(f: Fields) -> list[int]:
    """Each prompt's size in a `/generate` batch, measured as `measure_prompt` measures it (UTF-8
    bytes of a text, the count of token ids); only read for per-prompt budgets, after
    `measure_prompt` has checked the shape."""
    if f.input_ids:  # (SGLang reads them when both are given)
        return [len(x) for x in _id_lists_decoder.decode(bytes(f.input_ids))]
    return [len(x.encode()) for x in _texts_decoder.decode(bytes(f.text))]


def _id_range(ids: list[int], param: str, raw: bytes | None = None) -> int:
    """The largest id of a token-id prompt; a negative id is a 400. `raw`: the ids' JSON,
    when they were read from it as plain integers (no `-` in it: none is negative, and the
    pass for the smallest is saved)."""
    if (raw is None or raw.find(b"-") >= 0) and min(ids) < 0:  # (`find`: common/jsonbytes.py)
        raise BadRequest(f"Token id {min(ids)} is out of vocabulary", param=param)
    return max(ids)


def prompt_param(route: RouteKind, f: Fields) -> str:
    if route is _GENERATE:
        return "input_ids" if f.input_ids else "text"
    return "messages" if route is _CHAT else "prompt"


def measure_prompt(route: RouteKind, f: Fields) -> tuple[int, bool, int, int, bool, int]:
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
    if route is _CHAT:
        return _measure_messages(bytes(f.messages))
    if route is _COMPLETIONS:
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
    return _measure_list(data, item, param, texts, ids, lax=route is RouteKind.COMPLETIONS)


def _measure_messages(data: bytes) -> tuple[int, bool, int, int, bool, int]:
    """`measure_prompt` of a chat's `messages` (their JSON)."""
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


def _measure_list(
    data: bytes, item: bytes, param: str, texts: bool, ids: bool, *, lax: bool
) -> tuple[int, bool, int, int, bool, int]:
    """`measure_prompt` of a prompt given as a JSON list (`data`, its first item starting with
    `item`): strings, token ids, or lists of token ids. `lax`: token ids are read as the
    OpenAI routes' pydantic reads them where plain integers fail (`_lax_token_ids`)."""
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
        if lax:
            found = _lax_token_ids(_any_decoder.decode(data))
            if found is not None:
                return found
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


def other_ids(route: RouteKind, f: Fields) -> list[tuple[int, str, bool]]:
    """(largest id, parameter, read as an index) of the token ids an engine reads besides the
    prompt: SGLang's chat `input_ids` (its prompt when given: the template is skipped,
    serving_chat.py:1947), and `stop_token_ids` (top level, or in `/generate`'s
    `sampling_params`, one object or a list): with a minimum length, SGLang 0.5.23 scatters them
    into a vocabulary-wide tensor (penaltylib/min_new_tokens.py) and its scheduler dies on one
    outside the vocabulary (then they are read as an index, as a prompt's ids are); vLLM refuses
    those itself. Negative ids and shapes no engine reads as ids are a 400."""
    out: list[tuple[int, str, bool]] = []
    if route is RouteKind.CHAT and given(f.input_ids):
        out.append((_lax_id_list(bytes(f.input_ids), "input_ids", empty_ok=False), "input_ids", True))
    if given(f.stop_token_ids):
        top = _lax_id_list(bytes(f.stop_token_ids), "stop_token_ids")
        out.append((top, "stop_token_ids", _positive(f.min_tokens)))
    sp = f.sampling_params
    for x in sp if isinstance(sp, list) else (sp,) if sp is not None else ():
        if given(x.stop_token_ids):
            top = _lax_id_list(bytes(x.stop_token_ids), "stop_token_ids")
            out.append((top, "stop_token_ids", _positive(x.min_new_tokens)))
    return out


def _positive(raw: msgspec.Raw) -> bool:
    """Is a minimum length given that may be above 0 (anything but a zero, or absent)?"""
    if not given(raw):
        return False
    try:
        value = _any_decoder.decode(bytes(raw))
        return not (isinstance(value, (int, float, str)) and float(value) == 0)
    except (msgspec.DecodeError, ValueError):
        return True


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
    if raw.find(b"\\") < 0:  # (not `in`: common/jsonbytes.py)
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
