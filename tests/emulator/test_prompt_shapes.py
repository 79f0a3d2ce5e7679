"""Prompt shapes the engines' request schemas refuse (vLLM's and SGLang's OpenAI routes are
pydantic models: `messages` a list of role-tagged objects, `prompt` a string, strings, token ids
or lists of them) are a 400 from the emulator, as from the engines, not a crash (500): a gateway
in front would otherwise count the client's bad input against the worker."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from emulator import tokenizer
from emulator.stops import Stopper, StopSpec
from tests.emulator.conftest import Factory

BAD: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": [1]}),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/completions", {"prompt": [1, "a"]}),
    ("/v1/completions", {"prompt": ["a", 1]}),
    ("/v1/completions", {"prompt": [[1], "a"]}),
    ("/v1/completions", {"prompt": [1.5, 2]}),
    ("/v1/completions", {"prompt": ["7", "x", 1]}),
    ("/v1/completions", {"prompt": [["a"]]}),
]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("path", "fields"), BAD)
async def test_a_prompt_of_the_wrong_shape_is_a_400(
    emu: Factory, http: aiohttp.ClientSession, engine: str, path: str, fields: dict[str, Any]
) -> None:
    h = await emu(engine, "both")
    body = {"model": "m", "max_tokens": 2, **fields}
    async with http.post(h.url + path, json=body) as r:
        assert r.status == 400, await r.text()
        got = await r.json()
    message = got["error"]["message"] if "error" in got else got["message"]
    assert "validation error" in message
    async with http.post(
        h.url + path.replace("chat/", ""), json={"model": "m", "prompt": [[1, 2], [3]]}
    ) as r:
        assert r.status == 200, await r.text()  # the right shapes still serve


async def test_vllm_refuses_an_empty_token_id_prompt_in_a_batch(
    emu: Factory, http: aiohttp.ClientSession
) -> None:
    """v1/engine/input_processor.py: "The decoder prompt cannot be empty" (a 400), not a 200 with
    text made of nothing (found by the API probe)."""
    h = await emu("vllm", "both")
    body = {"model": "m", "max_tokens": 2, "prompt": [[1], []]}
    async with http.post(h.url + "/v1/completions", json=body) as r:
        assert r.status == 400, await r.text()
        assert (await r.json())["error"]["message"] == "The decoder prompt cannot be empty"


def test_a_stop_string_matches_only_where_the_new_token_completes_it() -> None:
    """vLLM searches only the window the new token can complete: a short stop string that lay
    wholly inside the `min_tokens` stretch does not end the sequence later."""
    st = Stopper(StopSpec(("ab", "wxyz1"), min_tokens=3, strings_wait=True))
    ids = [ord(c) + tokenizer.BYTE_OFFSET for c in "xabyzq"]
    assert not any(st.feed(t) for t in ids)
