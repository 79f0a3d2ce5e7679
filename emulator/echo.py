"""`echo` and the prompt's logprobs on the completions routes, shaped as both engines shape them.

`echo` puts the prompt's text before each choice's text (a stream: before the first chunk of
each choice). The choice's `logprobs` may then cover the prompt's tokens first (vLLM: whenever
it computed prompt logprobs; SGLang: `echo` with a non-zero `logprobs`, except on a P/D decode,
which never computed the prompt): the very first prompt token has no logprob (`token_logprobs`
and `top_logprobs` null), and `text_offset` counts from the start of the echoed text.

vLLM's `prompt_logprobs: k` extension answers a list, `null` for the first prompt token and then
`{"<token id>": {"logprob", "rank", "decoded_token"}}` for the prompt token and its best
alternatives (k entries, at least the token itself; the emulated prompt token is always rank 1).
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from emulator import tokenizer
from emulator.logprobs import MAX_LOGPROBS, LogprobAsk, alternatives, logprobs


class Echo(msgspec.Struct, frozen=True):
    """What a choice shows before its output."""

    text: str = ""  # the echoed prompt text ("" when not echoing)
    offset: int = 0  # `text_offset` of the first output token
    logprobs: dict[str, Any] | None = None  # the prompt's part of the choice's logprobs
    only: bool = False  # echo without generation (vLLM's `max_tokens` 0): the output is dropped


NO_ECHO = Echo()


def prompt_offset(prompt: list[int]) -> int:
    """The length of the prompt's token texts (where the output's `text_offset` starts)."""
    return sum(len(tokenizer.token_text(t)) for t in prompt)


def echo(
    prompt: list[int], ask: LogprobAsk | None, *, show_text: bool, scored: bool, only: bool = False
) -> Echo:
    """The echo of `prompt`: its text when `show_text`, its logprobs when `scored` (and asked)."""
    lp = prompt_part(ask, prompt) if scored and ask is not None else None
    return Echo(tokenizer.decode(prompt) if show_text else "", prompt_offset(prompt), lp, only)


def echoed(ec: Echo, text: str, lp: dict[str, Any] | None) -> tuple[str, dict[str, Any] | None]:
    """A choice's (or its first chunk's) text and logprobs with the echo before them."""
    if ec.only:
        return ec.text, ec.logprobs
    return ec.text + text, join(ec.logprobs, lp)


def prompt_part(ask: LogprobAsk, prompt: list[int]) -> dict[str, Any]:
    """A completions `logprobs` object for the prompt's tokens (the first one unscored)."""
    if not prompt:
        return {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    first = tokenizer.token_text(prompt[0])
    rest = logprobs(ask, prompt[1:], prompt[0], len(first))
    return {
        "text_offset": [0, *rest["text_offset"]],
        "token_logprobs": [None, *rest["token_logprobs"]],
        "tokens": [first, *rest["tokens"]],
        "top_logprobs": [None, *rest["top_logprobs"]],
    }


def join(head: dict[str, Any] | None, tail: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions `logprobs` objects one after the other (either may be None)."""
    if head is None:
        return tail
    if tail is None:
        return dict(head)
    return {key: head[key] + tail[key] for key in head}


def vllm_prompt_logprobs(prompt: list[int], k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` list for `prompt` with `k` alternatives (-1: all of them)."""
    top = tokenizer.VOCAB_SIZE if k == -1 else max(1, k)
    out: list[dict[str, Any] | None] = [None]
    for prev, tok in itertools.pairwise(prompt):
        out.append(
            {
                str(t): {"logprob": lp, "rank": rank, "decoded_token": tokenizer.token_text(t)}
                for rank, (t, lp) in enumerate(alternatives(prev, tok, top), start=1)
            }
        )
    return out


def vllm_prompt_logprobs_k(body: dict[str, Any], chat: bool, ask: LogprobAsk | None) -> int | None:
    """How many prompt logprob alternatives a vLLM request computes, or None (none computed).
    `prompt_logprobs` when given, else, with `echo`, a completion's `logprobs` or a chat's
    `top_logprobs` (0 by default: ``ChatCompletionRequest.to_sampling_params``,
    chat_completion/protocol.py:742-744, so a chat echo always scores its prompt and reads no
    cached prefix). ValueError (with vLLM's message) for a value it refuses."""
    k = body.get("prompt_logprobs")
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int):
            raise ValueError("`prompt_logprobs` must be an integer.")
        if k < 0 and k != -1:
            raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        if body.get("stream") and k != 0:
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        if k > MAX_LOGPROBS:
            raise ValueError(
                f"Requested prompt logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}"
            )
        return k
    if not body.get("echo"):
        return None
    if chat:
        top = body.get("top_logprobs", 0)  # checked with `logprobs` (logprob_ask)
        return top if isinstance(top, int) and not isinstance(top, bool) else None
    return ask.top if ask is not None else None


def vllm_chat_echo(body: dict[str, Any]) -> str:
    """What vLLM's chat `echo` puts before each choice's content: the last message's content when
    that message has the answer's role (the response role, "assistant"; with
    `add_generation_prompt` false the last message's own role: ``get_chat_request_role``,
    chat_completion/serving.py:433-436), else nothing (serving.py:1132-1145; a stream sends it
    in a chunk of its own after the role chunks, :591-624). Text parts of a list content are
    joined with newlines, as vLLM's conversation parser joins them (renderers/chat_utils.py:1883)."""
    messages = body.get("messages")
    if not body.get("echo") or not isinstance(messages, list) or not messages:
        return ""
    last = messages[-1]
    if not isinstance(last, dict):
        return ""
    role = "assistant" if body.get("add_generation_prompt", True) else last.get("role")
    if last.get("role") != role:
        return ""
    content = last.get("content")
    if isinstance(content, list):
        return "\n".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return content if isinstance(content, str) else ""
