"""How vLLM reads a completions or chat request: its prompts, output budget, sampling and
logprob asks, and the renderer's and engine's length checks (before any work)."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
from aiohttp import web

from emulator import tokenizer
from emulator.echo import NO_ECHO, Echo, echo, vllm_prompt_logprobs_k
from emulator.logprobs import LogprobAsk, logprob_ask
from emulator.stops import StopSpec, stop_spec
from emulator.vllm.errors import error


class Parsed(msgspec.Struct):
    """A request as vLLM reads it: the prompts (`texts`: each one given as text, not ids),
    samples per prompt, asks; `limits` is the body as its lengths count (echo without
    generation: one token)."""

    prompts: list[list[int]]
    texts: list[bool]
    n: int
    ask: LogprobAsk | None
    stop: StopSpec | None
    plp_k: int | None
    echo_only: bool
    limits: dict[str, Any]


def sample_seed(body: dict[str, Any]) -> int | None:
    t = body.get("temperature")
    if t is None or float(t) <= 0.0:
        return None
    seed = body.get("seed")
    return int(seed) if seed is not None else secrets.randbits(31)


def echo_of(prompt: list[int], body: dict[str, Any], chat: bool, ask: LogprobAsk | None) -> Echo:
    """A completion's echo: the prompt's text (none when it answers token ids) and, with
    `logprobs`, the prompt's logprobs; `max_tokens` 0 echoes without generation."""
    if chat or not body.get("echo"):
        return NO_ECHO
    only = body.get("max_tokens") == 0
    return echo(prompt, ask, show_text=not body.get("return_token_ids"), scored=True, only=only)


def out_limit(body: dict[str, Any], chat: bool) -> tuple[str, int | None]:
    """The request's output-token limit as vLLM reads it, with its field's name: chat's
    ``max_completion_tokens`` when set, else ``max_tokens`` (chat_completion/protocol.py:
    658-663, chat_completion/serving.py:343-347); completions have ``max_tokens`` only, 16
    when absent (completion/protocol.py:63)."""
    if chat:
        mct = body.get("max_completion_tokens")
        if mct is not None:
            return "max_completion_tokens", int(mct)
        mt = body.get("max_tokens")
    else:
        mt = body.get("max_tokens", 16)
    return "max_tokens", None if mt is None else int(mt)


def _prompts(body: dict[str, Any], chat: bool) -> tuple[list[list[int]], list[bool]]:
    texts = [True]  # per prompt: text (tokenized here), not token ids
    if chat:
        return [tokenizer.encode_chat(body.get("messages") or [])], texts
    p = body.get("prompt", "")
    if isinstance(p, list) and p and isinstance(p[0], int):
        return [[int(x) for x in p]], [False]
    if isinstance(p, list) and p:
        prompts = [[int(t) for t in x] if isinstance(x, list) else tokenizer.encode(str(x)) for x in p]
        return prompts, [not isinstance(x, list) for x in p]
    if isinstance(p, list):
        return [tokenizer.encode("")], texts
    return [tokenizer.encode(str(p))], texts


def parse(body: dict[str, Any], chat: bool, max_logprobs: int) -> Parsed | web.Response:
    """The request's fields as vLLM's request models read them, or their 400."""
    if body.get("stream_options") and not body.get("stream"):
        # the request model's validate_stream_options (entrypoints/openai/completion/protocol.py,
        # chat_completion/protocol.py): refused while parsing, so no KV cleanup either
        return error(
            400,
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
            param="stream_options",
        )
    prompts, texts = _prompts(body, chat)
    try:
        n_samples = 1 if body.get("n") is None else int(body["n"])
    except (TypeError, ValueError):
        return error(400, "n must be an integer", param="n")
    try:
        ask = logprob_ask(body, chat, max_logprobs)
        stop = stop_spec(body, "include_stop_str_in_output", "min_tokens", strings_wait=True)
    except ValueError as e:
        return error(400, str(e))
    try:
        plp_k = vllm_prompt_logprobs_k(body, chat, ask)
    except ValueError as e:
        return error(400, str(e), param="prompt_logprobs")
    # echo without generation: vLLM generates one token and drops it
    echo_only = not chat and bool(body.get("echo")) and body.get("max_tokens") == 0
    limits = {**body, "max_tokens": 1} if echo_only else body
    if n_samples < 1:
        return error(400, f"n must be at least 1, got {n_samples}.", param="n")
    return Parsed(prompts, texts, n_samples, ask, stop, plp_k, echo_only, limits)


class Lengths:
    """The length checks against the served model's `max_len` (``--max-model-len``)."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def max_new_for(self, prompt: list[int], body: dict[str, Any], chat: bool) -> int:
        """``get_max_tokens`` (entrypoints/serve/utils/api_utils.py:169-205): the request's
        limit clamped to the room its prompt leaves, the whole room when it sets none. Not
        refused here: a result below 1 is ``SamplingParams``' refusal (``vllm_refusal``)."""
        mt = out_limit(body, chat)[1]
        room = self.max_len - len(prompt)
        return room if mt is None else min(mt, room)

    def check_output_limit(self, body: dict[str, Any], chat: bool) -> web.Response | None:
        """``TokenizeParams.__post_init__`` (renderers/params.py:256-268), run when the renderer
        builds its params (``build_tok_params``), before any prompt is tokenized."""
        max_len = self.max_len
        param, mt = out_limit(body, chat)
        mt = mt or 0  # build_tok_params: ``max_output_tokens=... or 0``
        if mt > max_len:
            return error(
                400,
                f"{param}={mt} cannot be greater than max_model_len={max_len}. Please request fewer "
                f"output tokens. (parameter={param}, value={mt})",
                param=param,
            )
        return None

    def check_length(self, prompt: list[int], text: bool) -> web.Response | None:
        max_len = self.max_len
        if not prompt and not text:
            # v1/engine/input_processor.py _validate_model_input: a ValueError, a 400
            return error(400, "The decoder prompt cannot be empty")
        if prompt and (min(prompt) < 0 or max(prompt) >= tokenizer.VOCAB_SIZE):
            # vLLM's renderer validates prompt token ids (VLLMValidationError -> 400)
            bad = min(prompt) if min(prompt) < 0 else max(prompt)
            return error(400, f"Token id {bad} is out of vocabulary")
        n_prompt = len(prompt)
        if n_prompt > max_len:
            # TokenizeParams._token_len_check (renderers/params.py:515-535). A text prompt (chat's
            # too: its template renders text) is tokenized with max_length = max_model_len + 1
            # (get_encode_kwargs, :351-376), so it counts at most that many; the qualifier
            # follows the count alone.
            count = min(n_prompt, max_len + 1) if text else n_prompt
            qualifier = "at least " if count == max_len + 1 else ""
            return error(
                400,
                f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
                f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
                f"Please reduce the length of the input prompt. (parameter=input_tokens, value={count})",
                param="input_tokens",
            )
        return None

    def engine_refusal(self, prompts: list[list[int]]) -> str | None:
        """The engine's own prompt check (v1/engine/input_processor.py:557-601): a prompt that
        fills the context leaves no room for the one token ``SamplingParams`` asks at least.
        Reached only by an echo without generation (its ``max_tokens`` is 1 whatever the room,
        completion/protocol.py:377,395): any other such prompt got ``max_tokens`` 0 and was
        refused by ``SamplingParams``."""
        max_len = self.max_len
        for pr in prompts:
            if len(pr) == max_len:
                return (
                    f"The decoder prompt (length {max_len}) plus the number of requested output tokens "
                    f"(at least 1) is longer than the maximum model length of {max_len}. Make sure that "
                    "`max_model_len` is no smaller than the number of text tokens (prompt + requested "
                    "output tokens)."
                )
        return None
