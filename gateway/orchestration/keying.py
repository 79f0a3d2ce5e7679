"""A request's prompt as a `PromptKey` (policies/prompt_key.py), for policies that match prefixes.

Made once per request, and only where the policy reads it (`Needs.prompt_key`): token ids where
the request has them (a completions `prompt` of ids, `/generate`'s `input_ids`, SGLang's chat
`input_ids`, which replace its template), else the text (a completions `prompt` or `/generate`
`text` as given; a chat's messages and tools rendered canonically by `PromptKey.from_chat`).
Batches are not keyed (None), nor is a prompt in a form only the engines' lax readers take
(ids as strings or floats): its routing is then load-aware without the cache.

With a routing tokenizer (gateway/routing_tokenizer.py, given only while some worker publishes
KV events) a text key also carries the ids the engine will see, for the precise index's block
hashes; the key stays a text key (the approximate index is keyed as without one). A chat gets
them only where the tokenizer renders chats exactly (`chat_ids` not None). A long text prompt
for an `hf` tokenizer is keyed without ids at first and tokenized in a worker thread as it is
served, before it is routed (`later`; `Tokenizing.offloads`).

A text prompt's JSON string without escapes is its UTF-8 text between the quotes: taken as it
is, without decoding it (the usual case, and the cheap one for a long prompt).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import msgspec

from common.request import ParsedRequest
from common.workers import RouteKind
from gateway.routing_tokenizer import RoutingTokenizer
from policies.prompt_key import PromptKey

if TYPE_CHECKING:
    from gateway.orchestration.context import RequestContext

_ids = msgspec.json.Decoder(list[int])
_text = msgspec.json.Decoder(str)
_any = msgspec.json.Decoder()


def prompt_key(req: ParsedRequest, tokenizer: RoutingTokenizer | None = None) -> PromptKey | None:
    """The key of the request's prompt; None for a batch or a prompt it cannot key."""
    if req.is_batch:
        return None
    f = req.fields
    try:
        if req.route is RouteKind.CHAT:
            if f.input_ids:  # SGLang's chat: these ids are its prompt (the template is skipped)
                return PromptKey.from_token_ids(_ids.decode(f.input_ids))
            tools = _any.decode(f.tools) if f.tools else None
            messages = _any.decode(f.messages)
            key = PromptKey.from_chat(messages, tools)
            if key is not None and tokenizer is not None:
                key.token_ids = tokenizer.chat_ids(messages, tools)
            return key
        if req.route is RouteKind.COMPLETIONS:
            raw = bytes(f.prompt)
        else:  # /generate: SGLang reads `input_ids` whenever they are given
            raw = bytes(f.input_ids) if f.input_ids else bytes(f.text)
        if req.prompt_is_ids:
            return PromptKey.from_token_ids(_ids.decode(raw))
        raw = raw.strip()
        if raw.find(b"\\") < 0 and raw[:1] == b'"' and raw[-1:] == b'"':  # (`find`: common/jsonbytes.py)
            data = raw[1:-1]
        else:
            data = _text.decode(raw).encode("utf-8", "surrogatepass")
        ids = None if tokenizer is None else tokenizer.text_ids(data)
        return PromptKey("text", data, len(data), ids)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def later(ctx: RequestContext) -> bool:
    """Tokenize the request's text prompt in a worker thread (`ctx.tokenize`, an `hf` tokenizer:
    gateway/routing_tokenizer.py), so that the event loop serves others meanwhile; its key gets
    the ids and its view their count. False where there was nothing to tokenize."""
    tok, ctx.tokenize = ctx.tokenize, None
    key = ctx.view.prompt_key
    if tok is None or key is None or key.kind != "text" or key.token_ids is not None:
        return False
    ids = await asyncio.get_running_loop().run_in_executor(None, tok.text_ids_unlocked, key.data)
    key.token_ids = ids
    ctx.view = msgspec.structs.replace(ctx.view, prompt_tokens=len(ids))
    return True
