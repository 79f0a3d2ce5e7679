"""The routing tokenizer (gateway/routing_tokenizer.py) and the prompt keys it fills in.

- the emulator kind gives the emulator's own ids, for text and for chats (its template);
- the hf kind gives what a real `tokenizer.json` gives with its special tokens (a file built
  here with the `tokenizers` library), and leaves chats untokenized;
- a keyed text prompt carries the ids for the precise index and keeps its text key for the
  approximate one (the same chain as without a tokenizer), and counts its ids as its length;
- the gateway tokenizes only where the policy has a precise index and a worker publishes KV
  events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from adapters.blockhash import HashSpec, make_hasher
from common.workers import RouteKind
from emulator import tokenizer as emu
from gateway.app import Gateway
from gateway.config import ConfigError, config_from_raw
from gateway.orchestration.context import request_view
from gateway.orchestration.keying import prompt_key
from gateway.routing_tokenizer import (
    EmulatorTokenizer,
    HfTokenizer,
    TokenizerConfig,
    Tokenizing,
    make_tokenizer,
)
from policies.prompt_key import PromptKey
from tests.unit.test_cache_feedback import parsed

TEXTS = ["hello world", 'say "hi"\n', "caf\u00e9 \u2603", "", "x" * 300]


@pytest.mark.parametrize("text", TEXTS)
def test_the_emulator_kind_gives_the_emulators_ids(text: str) -> None:
    got = EmulatorTokenizer().text_ids(text.encode())
    assert list(got) == emu.encode(text) and len(got) == len(emu.encode(text))
    assert tuple(got[1:17]) == tuple(emu.encode(text)[1:17])  # (as the hashers read blocks)


def test_bytes_no_utf8_has_still_get_the_emulators_rule() -> None:
    assert list(EmulatorTokenizer().text_ids(b"a\xfd\xff")) == [1, 100, 256, 258]


CHATS: list[Any] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "caf\u00e9"}],
    [{"content": "no role"}, {"role": "assistant", "content": None}],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
        }
    ],
    [],
]


@pytest.mark.parametrize("messages", CHATS)
def test_the_emulator_kind_renders_chats_as_its_template(messages: Any) -> None:
    got = EmulatorTokenizer().chat_ids(messages, None)
    assert got is not None and list(got) == emu.encode_chat(messages)


@pytest.mark.parametrize(
    "messages",
    [
        "not a list",
        [1, 2],
        [{"role": "user", "content": {"a": 1}}],  # the emulator would render str(dict)
        [{"role": None, "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    ],
)
def test_chats_the_emulator_kind_cannot_render_exactly_get_no_ids(messages: Any) -> None:
    assert EmulatorTokenizer().chat_ids(messages, None) is None


def write_tokenizer_json(path: Path) -> Path:
    """A real tokenizer.json: word-level, whitespace split, BOS added by its post-processor."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "hello": 2, "world": 3, "the": 4, "cat": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path))
    return path


def test_the_hf_kind_encodes_with_the_files_special_tokens(tmp_path: Path) -> None:
    tok = make_tokenizer(TokenizerConfig(kind="hf", path=str(write_tokenizer_json(tmp_path / "t.json"))))
    assert isinstance(tok, HfTokenizer)
    assert list(tok.text_ids(b"hello world the cat")) == [1, 2, 3, 4, 5]
    assert list(tok.text_ids(b"the dog")) == [1, 4, 0]
    # the gateway does not run a model's chat template: chats keep their text key
    assert tok.chat_ids([{"role": "user", "content": "hello"}], None) is None


def test_configuration(tmp_path: Path) -> None:
    cfg = config_from_raw({"tokenizer": {"kind": "emulator"}})
    assert cfg.tokenizer == TokenizerConfig(kind="emulator")
    assert config_from_raw({}).tokenizer is None  # off by default
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        config_from_raw({"tokenizer": {"kind": "hf"}})
    with pytest.raises(ConfigError, match="kind"):
        config_from_raw({"tokenizer": {"kind": "tiktoken"}})
    with pytest.raises(ValueError, match="cannot load it"):
        make_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path / "missing.json")))


# ---- keys -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "body", "text"),
    [
        (RouteKind.COMPLETIONS, {"prompt": "hello world"}, "hello world"),
        (RouteKind.COMPLETIONS, {"prompt": 'say "hi"\n'}, 'say "hi"\n'),  # escapes decoded first
        (RouteKind.COMPLETIONS, {"prompt": "caf\u00e9 \u2603"}, "caf\u00e9 \u2603"),
        (RouteKind.GENERATE, {"text": "abc"}, "abc"),
    ],
)
def test_a_text_key_carries_the_ids_and_keeps_its_text_key(
    route: RouteKind, body: dict[str, Any], text: str
) -> None:
    req = parsed(route, body)
    plain, tokenized = prompt_key(req), prompt_key(req, EmulatorTokenizer())
    assert plain is not None and tokenized is not None
    assert tokenized.token_ids is not None and list(tokenized.token_ids) == emu.encode(text)
    assert plain.token_ids is None
    # the approximate index is keyed as without a tokenizer
    assert (tokenized.kind, tokenized.data, tokenized.units) == (plain.kind, plain.data, plain.units)
    assert tokenized.approx_chain(4) == plain.approx_chain(4)


def test_the_engine_keys_of_a_tokenized_text_are_the_ids_keys() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 4
    key = prompt_key(parsed(RouteKind.COMPLETIONS, {"prompt": text}), EmulatorTokenizer())
    hasher = make_hasher(HashSpec(scheme="emulator", block_size=16))
    ids = PromptKey.from_token_ids(emu.encode(text))
    assert key is not None and ids is not None
    assert key.engine_keys(hasher, 100) == ids.engine_keys(hasher, 100)
    assert len(key.engine_keys(hasher, 100)) == len(emu.encode(text)) // 16 > 0


def test_chats_token_ids_and_batches() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    tok = EmulatorTokenizer()
    chat = prompt_key(parsed(RouteKind.CHAT, {"messages": msgs}), tok)
    assert chat is not None and chat.kind == "text"
    assert chat.token_ids is not None and list(chat.token_ids) == emu.encode_chat(msgs)
    assert chat.data == PromptKey.from_chat(msgs).data  # (its text key as without a tokenizer)
    ids = prompt_key(parsed(RouteKind.COMPLETIONS, {"prompt": [5, 6, 7]}), tok)
    assert ids is not None and ids.token_ids == (5, 6, 7) and ids.kind == "tokens"
    assert prompt_key(parsed(RouteKind.COMPLETIONS, {"prompt": ["a", "b"]}), tok) is None


def test_a_tokenized_prompt_counts_its_ids() -> None:
    req = parsed(RouteKind.COMPLETIONS, {"prompt": "abcdefgh" * 10})
    assert request_view(req, "r", 4.0, keyed=True).prompt_tokens == 21  # 80 chars / 4 + 1
    assert request_view(req, "r", 4.0, keyed=True, tokenizer=EmulatorTokenizer()).prompt_tokens == 81


# ---- when the gateway tokenizes ---------------------------------------------------------------------


def gateway(policy: Any, tokenizer: bool, kv: bool) -> Gateway:
    worker: dict[str, Any] = {"url": "http://127.0.0.1:9", "role": "colocated", "id": "w"}
    if kv:
        worker["kv_events"] = {"endpoint": "tcp://127.0.0.1:5557", "hash": "emulator"}
    raw: dict[str, Any] = {"workers": [worker], "policy": policy}
    if tokenizer:
        raw["tokenizer"] = {"kind": "emulator"}
    return Gateway(config_from_raw(raw), environ={})


def test_the_gateway_tokenizes_only_for_a_precise_index_with_kv_events() -> None:
    on = gateway("cache_aware", tokenizer=True, kv=True)
    assert isinstance(on.orchestrator.s.tokenizing, Tokenizing)
    assert isinstance(on.orchestrator.s.tokenizer(), EmulatorTokenizer)
    # no worker publishes KV events (yet: the admin API may add one): nothing is tokenized
    assert gateway("cache_aware", tokenizer=True, kv=False).orchestrator.s.tokenizer() is None
    assert gateway("cache_aware", tokenizer=False, kv=True).orchestrator.s.tokenizing is None
    assert gateway("least_load", tokenizer=True, kv=True).orchestrator.s.tokenizing is None
    approx = {"type": "cache_aware", "index": "approximate"}
    assert gateway(approx, tokenizer=True, kv=True).orchestrator.s.tokenizing is None
