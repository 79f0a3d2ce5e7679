"""The fields of a client request the gateway reads, as msgspec Structs decoded in one pass.

Unknown keys are ignored by the decode and passed through untouched in the body's bytes; the
prompts stay raw JSON (`common.prompt` measures them without decoding a string prompt)."""

from __future__ import annotations

from typing import Any

import msgspec

NULL = msgspec.Raw(b"null")


class SamplingParams(msgspec.Struct):
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    n: int | None = None
    sampling_seed: msgspec.Raw = msgspec.Raw()  # empty: absent
    stop_token_ids: msgspec.Raw = msgspec.Raw()  # empty: absent (token ids: checked like a prompt's)
    min_new_tokens: msgspec.Raw = msgspec.Raw()  # empty: absent (what makes SGLang read stop ids)


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class Fields(msgspec.Struct):
    """The keys the gateway reads. Unknown keys are ignored here and passed through untouched."""

    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    seed: msgspec.Raw = msgspec.Raw()  # empty: absent
    stream_options: StreamOptions | None = None
    # prompts, kept raw
    prompt: msgspec.Raw = msgspec.Raw()  # empty: absent
    messages: msgspec.Raw = msgspec.Raw()  # empty: absent
    text: msgspec.Raw = msgspec.Raw()  # empty: absent
    input_ids: msgspec.Raw = msgspec.Raw()  # empty: absent
    tools: msgspec.Raw = msgspec.Raw()  # empty: absent (a chat's tools: part of its prompt's key)
    sampling_params: SamplingParams | list[SamplingParams] | None = None  # a list: one per prompt
    return_logprob: bool | list[bool] | None = None  # a list: one per prompt (/generate batches)
    logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent
    echo: bool | None = None
    prompt_logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent (vLLM's extension)
    top_logprobs: msgspec.Raw = msgspec.Raw()  # empty: absent
    rid: msgspec.Raw = msgspec.Raw()  # empty: absent
    stop_token_ids: msgspec.Raw = msgspec.Raw()  # empty: absent (token ids: checked like a prompt's)
    min_tokens: msgspec.Raw = msgspec.Raw()  # empty: absent (what makes SGLang read stop ids)
    user: str | None = None
    session_id: Any = None  # not an engine field: a routing hint when a string or an integer
    # fields the gateway owns on the way to engines; a client must not smuggle them in
    bootstrap_host: msgspec.Raw = msgspec.Raw()  # empty: absent
    bootstrap_port: msgspec.Raw = msgspec.Raw()  # empty: absent
    bootstrap_room: msgspec.Raw = msgspec.Raw()  # empty: absent
    kv_transfer_params: msgspec.Raw = msgspec.Raw()  # empty: absent


def given(raw: msgspec.Raw | None) -> bool:
    """Is a raw JSON field's value set: present and neither null nor false?"""
    return raw is not None and bool(raw) and bytes(raw) not in (b"null", b"false")
