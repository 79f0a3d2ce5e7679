"""A JSON null for a field that vLLM's request models type without `| None` (`n: int = 1`,
`min_tokens: int = 0`, `ignore_eos: bool = False`, ...) is refused by pydantic while the request
is parsed: a 400 before any work, as real vLLM answers, not the field's default. A null for a
field typed `| None` (or one vLLM sets to its default, `max_tokens`) is served. The fields and
pydantic's words are vLLM 0.32's (`emulator.lax.VLLM_NO_NULL_*`; the last test checks them
against an installed vLLM)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from emulator.lax import VLLM_NO_NULL_CHAT, VLLM_NO_NULL_COMPLETIONS
from tests.emulator.conftest import Factory
from tests.emulator.test_lax_scalars import CHAT, C, body_for, message_of
from tests.emulator.test_sampling_checks import no_work_done, post

# nulls vLLM takes: the field's default (or, for max_tokens, normalize_null_max_tokens's)
TAKEN = {
    C: ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "logprobs", "echo",
        "stream", "stream_options", "frequency_penalty", "presence_penalty", "min_p", "user", "suffix"],
    CHAT: ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "seed", "stop", "logprobs",
           "top_logprobs", "stream", "stream_options", "stop_token_ids", "frequency_penalty"],
}  # fmt: skip


@pytest.mark.parametrize("path", [C, CHAT])
async def test_a_null_for_a_field_vllm_types_without_none_is_a_400(
    emu: Factory, http: aiohttp.ClientSession, path: str
) -> None:
    h = await emu("vllm", "both")
    fields = VLLM_NO_NULL_CHAT if path == CHAT else VLLM_NO_NULL_COMPLETIONS
    names = [k for k, _ in fields]
    for must in ("min_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
        assert must in names
    assert ("n" in names) == (path == C) and ("echo" in names) == (path == CHAT)
    for name, msg in fields:
        for stream in (False, True):
            s, raw = await post(http, h.url + path, body_for(path, stream=stream, **{name: None}))
            assert s == 400, (name, stream, raw)
            assert message_of("vllm", raw) == f"1 validation error: {name}: {msg}", raw
    # each one named, with the other refusals of the same request
    s, raw = await post(http, h.url + path, body_for(path, min_tokens=None, ignore_eos=None, max_tokens="x"))
    assert s == 400, raw
    message = message_of("vllm", raw)
    assert message.startswith("3 validation errors: "), message
    assert all(f"{k}: " in message for k in ("min_tokens", "ignore_eos", "max_tokens")), message
    await no_work_done(h)
    assert not h.dead


@pytest.mark.parametrize("path", [C, CHAT])
async def test_a_null_for_a_field_vllm_types_with_none_is_served(
    emu: Factory, http: aiohttp.ClientSession, path: str
) -> None:
    h = await emu("vllm", "both")
    for name in TAKEN[path]:
        body = body_for(path, **{name: None})
        if name == "max_tokens":
            body["max_tokens"] = None  # (the default then: 16 on completions, the room left on chat)
        s, raw = await post(http, h.url + path, body)
        assert s == 200, (name, raw)
        assert json.loads(raw)["usage"]["completion_tokens"] > 0, (name, raw)


async def test_sglang_still_reads_a_null_as_absent(emu: Factory, http: aiohttp.ClientSession) -> None:
    """(SGLang's models are not vLLM's: the tables are vLLM's alone.)"""
    h = await emu("sglang", "both")
    s, raw = await post(http, h.url + C, body_for(C, min_tokens=None, ignore_eos=None))
    assert s == 200, raw


def test_the_tables_are_the_installed_vllms() -> None:
    """Each model validated with each of its fields null: the refused ones and pydantic's words
    are the tables' (runs where vLLM is installed, as in .venv-vllm)."""
    pytest.importorskip("vllm")
    pydantic = pytest.importorskip("pydantic")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    cases: list[tuple[Any, dict[str, Any], tuple[tuple[str, str], ...]]] = [
        (CompletionRequest, {"model": "m", "prompt": "hi"}, VLLM_NO_NULL_COMPLETIONS),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            VLLM_NO_NULL_CHAT,
        ),
    ]
    for model, base, table in cases:
        refused = []
        for name, info in model.model_fields.items():
            key = info.alias or name
            if key in base:
                continue
            try:
                model.model_validate({**base, key: None})
            except pydantic.ValidationError as e:
                errors = e.errors()
                assert len(errors) == 1, (key, errors)
                refused.append((key, errors[0]["msg"]))
        assert tuple(refused) == table, (model.__name__, refused)
