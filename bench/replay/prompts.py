"""Prompts whose shared blocks are the same tokens, at exactly the row's length.

Each block id has one content: `block_tokens` *units*, strings that are exactly one token each
and that never merge with their neighbours, drawn by a generator seeded with the id (and a
salt). A row's prompt is its blocks' contents in order, the last block cut to the row's
length; the engine's own special tokens (a BOS) count in the first block. So two rows that
share an id share those tokens, and an engine's prefix cache, a router's radix tree of the
text and a router's token blocks all see the sharing.

Tokenizers (`PromptTokenizer`):
  * `ByteTokenizer`: the emulator's (emulator/tokenizer.py: one token per UTF-8 byte, BOS
    first): a unit is one lowercase letter or a space;
  * `HFTokenizer`: a `tokenizers` JSON file (`pip install 'pd-gateway[tokenizers]'`): units are
    single-token words with a leading space, which a word-splitting pre-tokenizer keeps apart;
  * `RemoteTokenizer`: the engine's own `POST /tokenize` (vLLM's; SGLang's has the same shape).
Every prompt's length is checked with the tokenizer before the run (`PromptBuilder.check`).
"""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Sequence
from typing import Protocol

from bench.replay.trace import BLOCK_TOKENS, Row
from gateway.routing_tokenizer import load_tokenizer_json

# Words tried as units by the word tokenizers: common English words, most of them one token
# in any BPE vocabulary trained on English.
CANDIDATE_WORDS = (
    "the of and to in is was for that on as with by he at from his it an were are which this be "
    "or had not but first one their its new after who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "also year through under between being well most house part high three since people "
    "back long film game team name like work life early while both well music world war "
    "government series found including several season north south east west under great day "
    "end place group area again same four five six seven eight nine ten small large water "
    "river road line church family power play home book club side party women men city land"
).split()


class PromptTokenizer(Protocol):
    """What the prompt builder needs from a tokenizer."""

    name: str

    def special_tokens(self) -> int:
        """Tokens the engine adds before the text (a BOS): they count in the prompt's length."""
        ...

    def units(self) -> Sequence[str]:
        """Strings that are one token each, whatever stands before or after them."""
        ...

    def count(self, text: str) -> int:
        """The text's tokens, without the special ones."""
        ...


class ByteTokenizer:
    """The emulator's tokenizer: one token per byte, BOS first (emulator/tokenizer.py)."""

    name = "bytes"

    def special_tokens(self) -> int:
        return 1

    def units(self) -> Sequence[str]:
        return tuple("abcdefghijklmnopqrstuvwxyz ")

    def count(self, text: str) -> int:
        return len(text.encode("utf-8"))


class _WordTokenizer:
    """Units: candidate words (leading space) that encode to exactly one token."""

    name = "words"
    _units: list[str] | None = None

    def encode_ids(self, text: str, special: bool) -> list[int]:
        raise NotImplementedError

    def special_tokens(self) -> int:
        return len(self.encode_ids("hello", True)) - len(self.encode_ids("hello", False))

    def units(self) -> Sequence[str]:
        if self._units is None:
            found = [w for w in dict.fromkeys(" " + c for c in CANDIDATE_WORDS) if self.count(w) == 1]
            if len(found) < 16:
                raise ValueError(
                    f"{self.name}: only {len(found)} of the candidate words are one token each; "
                    "this tokenizer does not split on spaces the way the prompt builder needs"
                )
            self._units = found
        return self._units

    def count(self, text: str) -> int:
        return len(self.encode_ids(text, False))


class HFTokenizer(_WordTokenizer):
    """A HuggingFace `tokenizers` JSON file (the model's tokenizer.json)."""

    def __init__(self, path: str) -> None:
        self.tok = load_tokenizer_json(path, "--tokenizer")
        self.name = f"tokenizer:{path}"

    def encode_ids(self, text: str, special: bool) -> list[int]:
        ids: list[int] = self.tok.encode(text, add_special_tokens=special).ids
        return ids


class RemoteTokenizer(_WordTokenizer):
    """The engine's `POST /tokenize` ({"model", "prompt", "add_special_tokens"} -> {"tokens"}),
    as vLLM's OpenAI server has it (vllm/entrypoints/openai/api_server.py)."""

    def __init__(self, base_url: str, model: str | None = None, timeout: float = 30.0) -> None:
        self.url = base_url.rstrip("/") + "/tokenize"
        self.model = model
        self.timeout = timeout
        self.name = f"remote:{self.url}"

    def encode_ids(self, text: str, special: bool) -> list[int]:
        body: dict[str, object] = {"prompt": text, "add_special_tokens": special}
        if self.model:
            body["model"] = self.model
        req = urllib.request.Request(
            self.url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            data = json.loads(resp.read())
        tokens = data.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError(f"{self.url} answered without a token list: {str(data)[:200]}")
        return [int(t) for t in tokens]


class LengthMismatch(ValueError):
    pass


class PromptBuilder:
    """Builds the prompt text of trace rows for one tokenizer (contents cached per block id)."""

    def __init__(
        self, tokenizer: PromptTokenizer, *, block_tokens: int = BLOCK_TOKENS, salt: str = ""
    ) -> None:
        self.tok = tokenizer
        self.block_tokens = block_tokens
        self.salt = salt
        self.special = tokenizer.special_tokens()
        self._units = list(tokenizer.units())
        self._blocks: dict[int, list[str]] = {}

    def block_units(self, block_id: int) -> list[str]:
        units = self._blocks.get(block_id)
        if units is None:
            rng = random.Random(f"{self.salt}/{block_id}")
            units = rng.choices(self._units, k=self.block_tokens)
            self._blocks[block_id] = units
        return units

    def text_tokens(self, row: Row) -> int:
        """Tokens the text must have: the row's length less the engine's special tokens."""
        n = row.input_length - self.special
        if n < 1:
            raise LengthMismatch(
                f"a prompt of {row.input_length} tokens leaves none for text after "
                f"{self.special} special token(s)"
            )
        return n

    def pieces(self, row: Row) -> list[str]:
        """The text of each block of the row, in order (the first one less the special tokens)."""
        left = self.text_tokens(row)
        out: list[str] = []
        for i, bid in enumerate(row.hash_ids):
            units = self.block_units(bid)
            first = self.special if i == 0 else 0
            take = min(self.block_tokens - first, left)
            out.append("".join(units[first : first + take]))
            left -= take
            if left <= 0:
                break
        if left > 0:
            raise LengthMismatch(
                f"{len(row.hash_ids)} blocks of {self.block_tokens} cannot hold {row.input_length} tokens"
            )
        return out

    def text(self, row: Row) -> str:
        return "".join(self.pieces(row))

    def check(self, row: Row, text: str) -> None:
        """Raise `LengthMismatch` unless the tokenizer counts exactly the row's length."""
        got = self.tok.count(text) + self.special
        if got != row.input_length:
            raise LengthMismatch(f"{self.tok.name}: the prompt built for {row.input_length} tokens has {got}")
