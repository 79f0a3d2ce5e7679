"""A long text prompt is tokenized off the event loop (gateway/routing_tokenizer.py): an `hf`
tokenizer's ids for a prompt over `offload_bytes` are left out of the request's key when its
context is made and filled in by a worker thread as it is served (`keying.later`), with
`encode_batch`, which releases the GIL; shorter prompts, chats, prompts of ids and the emulator
kind are tokenized inline as before. The loop's stall itself is measured by
`bench/replay/tokenize_cost.py`. And `serve --tokenizer KIND[:PATH]` sets `[tokenizer]`."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from common.workers import RouteKind
from gateway.app import Gateway
from gateway.cli_args import parse_serve_args
from gateway.config import ConfigError, config_from_raw
from gateway.orchestration.context import RequestContext
from gateway.orchestration.keying import later
from gateway.routing_tokenizer import HfTokenizer, TokenizerConfig
from tests.unit.test_cache_feedback import parsed
from tests.unit.test_routing_tokenizer import write_tokenizer_json

LONG = ("hello world the cat " * 300).strip()  # 5,999 bytes, 1,201 ids with BOS


def gateway(tmp_path: Path, **tokenizer: Any) -> Gateway:
    worker = {
        "url": "http://127.0.0.1:9",
        "role": "colocated",
        "id": "w",
        "kv_events": {"endpoint": "tcp://127.0.0.1:5557", "hash": "emulator"},
    }
    path = str(write_tokenizer_json(tmp_path / "t.json"))
    raw = {
        "workers": [worker],
        "policy": "cache_aware",
        "tokenizer": {"kind": "hf", "path": path, **tokenizer},
    }
    return Gateway(config_from_raw(raw), environ={})


async def context(gw: Gateway, route: RouteKind, body: dict[str, Any]) -> RequestContext:
    task = asyncio.current_task()
    assert task is not None
    return gw.orchestrator.context(parsed(route, body), "r", None, task)  # type: ignore[arg-type]


async def test_a_long_text_prompt_is_tokenized_in_a_worker_thread(tmp_path: Path) -> None:
    gw = gateway(tmp_path)
    tok = gw.orchestrator.s.tokenizer()
    assert isinstance(tok, HfTokenizer)
    ctx = await context(gw, RouteKind.COMPLETIONS, {"prompt": LONG})
    key = ctx.view.prompt_key
    assert key is not None and key.token_ids is None and ctx.tokenize is tok
    assert ctx.view.prompt_tokens == 1501  # the estimate (the JSON string / 4 + 1), until tokenized
    threads: list[int] = []
    encode = tok._batch

    def batch(*a: Any, **kw: Any) -> Any:
        threads.append(threading.get_ident())
        return encode(*a, **kw)

    tok._batch = batch
    assert await later(ctx)
    assert threads and threads[0] != threading.get_ident()  # not the event loop's thread
    assert list(key.token_ids or ()) == list(tok.text_ids(LONG.encode())) and len(key.token_ids or ()) == 1201
    assert ctx.view.prompt_tokens == 1201 and ctx.view.prompt_key is key and ctx.tokenize is None
    assert not await later(ctx)  # once


@pytest.mark.parametrize(
    ("route", "body"),
    [
        (RouteKind.COMPLETIONS, {"prompt": "hello world"}),  # short: inline
        (RouteKind.GENERATE, {"input_ids": [1, 2, 3] * 3000}),  # ids: nothing to tokenize
        (RouteKind.CHAT, {"messages": [{"role": "user", "content": LONG}]}),  # hf: chats keep text keys
    ],
)
async def test_other_prompts_are_keyed_as_before(
    tmp_path: Path, route: RouteKind, body: dict[str, Any]
) -> None:
    ctx = await context(gateway(tmp_path), route, body)
    assert ctx.tokenize is None
    key = ctx.view.prompt_key
    assert key is not None
    if route is RouteKind.COMPLETIONS:
        assert list(key.token_ids or ()) == [1, 2, 3]


async def test_offload_bytes_zero_keeps_every_prompt_inline(tmp_path: Path) -> None:
    ctx = await context(gateway(tmp_path, offload_bytes=0), RouteKind.COMPLETIONS, {"prompt": LONG})
    key = ctx.view.prompt_key
    assert ctx.tokenize is None and key is not None and len(key.token_ids or ()) == 1201
    with pytest.raises(ConfigError, match="offload_bytes"):
        gateway(tmp_path, offload_bytes=-1)


def test_the_unlocked_encoding_gives_the_same_ids(tmp_path: Path) -> None:
    tok = HfTokenizer(str(write_tokenizer_json(tmp_path / "t.json")))
    for text in (b"hello world the cat", b"the dog", b"", LONG.encode()):
        assert list(tok.text_ids_unlocked(text)) == list(tok.text_ids(text))


def test_the_tokenizer_flag(tmp_path: Path) -> None:
    assert parse_serve_args(["--tokenizer", "emulator"]).tokenizer == TokenizerConfig(kind="emulator")
    path = str(write_tokenizer_json(tmp_path / "t.json"))
    file = tmp_path / "g.toml"
    file.write_text('[tokenizer]\nkind = "emulator"\noffload_bytes = 99\n')
    got = parse_serve_args(["--config", str(file), "--tokenizer", f"hf:{path}"]).tokenizer
    assert got == TokenizerConfig(kind="hf", path=path, offload_bytes=99)  # the file's other keys kept
    assert parse_serve_args(["--config", str(file), "--tokenizer", "none"]).tokenizer is None
    for bad in ("hf", "emulator:x", "tiktoken"):
        with pytest.raises(ConfigError, match="--tokenizer takes"):
            parse_serve_args(["--tokenizer", bad])
