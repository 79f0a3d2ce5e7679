"""vLLM's answer shapes: stream chunks (role, echo, tokens, finish, usage) and whole answers,
key for key as vLLM 0.32 writes them."""

from __future__ import annotations

from typing import Any

from emulator import tokenizer
from emulator.echo import NO_ECHO, Echo, echoed
from emulator.logprobs import LogprobAsk, logprobs
from emulator.stops import Stopper
from emulator.wire import sse


def finish_of(stopper: Stopper | None) -> str:
    return "stop" if stopper is not None and stopper.matched is not None else "length"


def stop_reason_of(stopper: Stopper | None) -> str | int | None:
    """vLLM names what stopped a sequence: the stop string or the stop token id."""
    return None if stopper is None else stopper.matched


def usage(pt: int, ct: int, cached: int, stream: bool, details: bool) -> dict[str, Any]:
    """`details`: --enable-prompt-tokens-details. vLLM 0.32 fills `prompt_tokens_details` only
    with it and only when some prompt tokens were cached (`if self.enable_prompt_tokens_details
    and final_res.num_cached_tokens`, entrypoints/openai/completion/serving.py); a whole answer
    then says null, a stream's usage chunk (dumped with exclude_none) leaves it out."""
    u: dict[str, Any] = {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}
    d = {"cached_tokens": cached} if details and cached else None
    if not stream:
        u["prompt_tokens_details"] = d
        u["completion_tokens_details"] = None
    elif d is not None:
        u["prompt_tokens_details"] = d
    return u


def running_usage(pt: int, ct: int, chat: bool) -> dict[str, Any]:
    """A chunk's usage with `stream_options.continuous_usage_stats` (and `include_usage`:
    vLLM's should_include_usage, entrypoints/serve/utils/api_utils.py:289-301), the counts so
    far, as `UsageInfo(...).model_dump_json(exclude_unset=True)` writes them (chat also sets
    completion_tokens_details, to null)."""
    u: dict[str, Any] = {"prompt_tokens": pt, "total_tokens": pt + ct, "completion_tokens": ct}
    if chat:
        u["completion_tokens_details"] = None
    return u


def release(
    out: list[int],
    shown: int,
    last: bool,
    stopper: Stopper | None,
    ask: LogprobAsk | None,
    prompt: list[int],
    ec: Echo = NO_ECHO,
    first: bool = False,
) -> tuple[int, list[int], str, dict[str, Any] | None]:
    """What a stream shows after its newest token: (tokens shown from now on, the new ones,
    their text, their logprobs). A possible stop string's start stays held back. A choice's
    first chunk carries its echo (`first`; echo without generation: the echo alone)."""
    now = stopper.shown(len(out), last) if stopper is not None else len(out)
    new = out[shown:now]
    text = "".join(tokenizer.token_text(t) for t in new)
    lp = None
    if ask is not None and new:
        before = out[shown - 1] if shown else (prompt[-1] if prompt else 0)
        lp = logprobs(ask, new, before, ec.offset + shown)
    if first and ec is not NO_ECHO:
        return (now, new, *echoed(ec, text, lp))
    return now, new, text, lp


def token_choice(
    index: int,
    chat: bool,
    text: str,
    lp: dict[str, Any] | None,
    new: list[int],
    last: bool,
    stopper: Stopper | None,
    shown: int,
    prompt: list[int],
    return_ids: bool,
) -> dict[str, Any]:
    """A stream chunk's choice for the tokens `new` (chat: a delta; the finish comes in a chunk
    of its own. Completions: the last one carries the finish)."""
    if chat:
        return {
            "index": index,
            "delta": {"content": text},
            "logprobs": lp,
            "finish_reason": None,
            "token_ids": new if return_ids else None,
        }
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": lp,
        "finish_reason": finish_of(stopper) if last else None,
        "stop_reason": stop_reason_of(stopper) if last else None,
    }
    if return_ids:
        choice["prompt_token_ids"] = prompt if shown == 0 else None
        choice["token_ids"] = new
    return choice


def answer_text(
    out: list[int],
    stopper: Stopper | None,
    ask: LogprobAsk | None,
    prompt: list[int],
    ec: Echo,
    chat_echo: str,
) -> tuple[str, dict[str, Any] | None]:
    """A whole answer's text and logprobs for the output `out` (a stop string's text cut)."""
    shown_ids = out[: stopper.shown(len(out), True)] if stopper is not None else out
    prev = prompt[-1] if prompt else 0
    lps = logprobs(ask, shown_ids, prev, ec.offset) if ask is not None else None
    text, lps = echoed(ec, tokenizer.decode(shown_ids), lps)
    return chat_echo + text, lps


class Shape:
    """What every chunk and answer of one request shares: id, creation time, model, object
    name, the system fingerprint and the stream options."""

    def __init__(
        self,
        oid: str,
        created: int,
        model: str,
        chat: bool,
        fingerprint: str,
        body: dict[str, Any],
        details: bool = False,
    ) -> None:
        self.oid = oid
        self.details = details  # --enable-prompt-tokens-details
        self.created = created
        self.model = model
        self.chat = chat
        self.fingerprint = fingerprint
        self.obj_name = "chat.completion.chunk" if chat else "text_completion"
        opts = body.get("stream_options") or {}
        self.include_usage = bool(opts.get("include_usage"))
        self.continuous = self.include_usage and bool(opts.get("continuous_usage_stats"))
        self.return_ids = bool(body.get("return_token_ids"))

    @property
    def stamp(self) -> dict[str, Any]:
        """A stream's terminal chunks (those with a finish_reason) carry the system fingerprint
        when no usage chunk follows to carry it (completion/serving.py:425-432,
        chat_completion/serving.py:803-811)."""
        return {} if self.include_usage else {"system_fingerprint": self.fingerprint}

    def _running(self, pt: int, ct: int, chat: bool) -> dict[str, Any]:
        return {"usage": running_usage(pt, ct, chat)} if self.continuous else {}

    def chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        c = {"id": self.oid, "object": self.obj_name, "created": self.created, "model": self.model}
        return sse(c | {"choices": [choice]} | extra)

    def role_chunk(self, index: int, prompt: list[int]) -> bytes:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self.chunk(
            choice,
            prompt_token_ids=prompt if self.return_ids else None,
            prompt_text=None,
            **self._running(len(prompt), 0, True),
        )

    def echo_chunk(self, index: int, text: str, n_prompt: int) -> bytes:
        """A chat stream's echo (``vllm_chat_echo``): a chunk of its own per choice after the role
        chunks, no finish or logprobs (chat_completion/serving.py:591-624)."""
        choice = {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        return self.chunk(choice, **self._running(n_prompt, 0, True))

    def token_chunk(self, choice: dict[str, Any], last: bool, n_prompt: int, n_out: int) -> bytes:
        extra = (self.stamp if last and not self.chat else {}) | self._running(n_prompt, n_out, self.chat)
        return self.chunk(choice, **extra)

    def finish_chunk(
        self, index: int, finish: str, stop_reason: str | int | None, n_prompt: int, ct: int
    ) -> bytes:
        """A chat choice's finish, in a chunk of its own."""
        choice = {
            "index": index,
            "delta": {"content": ""},
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": None,
        }
        return self.chunk(choice, **self.stamp, **self._running(n_prompt, ct, True))

    def usage_chunk(self, pt: int, ct: int, cached: int) -> bytes:
        c = {"id": self.oid, "object": self.obj_name, "created": self.created, "model": self.model}
        return sse(
            c
            | {
                "choices": [],
                "usage": usage(pt, ct, cached, True, self.details),
                "system_fingerprint": self.fingerprint,
            }
        )

    def choice(
        self,
        index: int,
        text: str,
        lps: dict[str, Any] | None,
        finish: str,
        stopper: Stopper | None,
        out: list[int],
        prompt: list[int],
        prompt_lps: list[dict[str, Any] | None] | None,
    ) -> dict[str, Any]:
        """A whole answer's choice."""
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning": None,
            }
            return {
                "index": index,
                "message": message,
                "logprobs": lps,
                "finish_reason": finish,
                "stop_reason": stop_reason_of(stopper),
                "token_ids": out if self.return_ids else None,
                "routed_experts": None,
            }
        return {
            "index": index,
            "text": text,
            "logprobs": lps,
            "finish_reason": finish,
            "stop_reason": stop_reason_of(stopper),
            "token_ids": out if self.return_ids else None,
            "prompt_logprobs": prompt_lps,
            "prompt_token_ids": prompt if self.return_ids else None,
            "routed_experts": None,
        }

    def whole(
        self,
        choices: list[dict[str, Any]],
        usage_: dict[str, Any],
        prompt: list[int],
        prompt_lps: list[dict[str, Any] | None] | None,
        params_out: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """A whole answer (`prompt`, `prompt_lps`: the first prompt's, on chat answers)."""
        obj: dict[str, Any] = {
            "id": self.oid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.fingerprint,
            "usage": usage_,
        }
        if self.chat:
            obj["prompt_logprobs"] = prompt_lps
            obj["prompt_token_ids"] = prompt if self.return_ids else None
            obj["prompt_text"] = None
        return obj | {"kv_transfer_params": params_out, "ec_transfer_params": None, "metrics": None}
