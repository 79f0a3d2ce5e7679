"""A routing tokenizer: the token ids the engines will see for a text prompt, so that the
precise (KV-event) index can hash a text prompt's blocks as the engine does.

The gateway forwards prompts untouched; these ids are used for routing only: the engine block
hashes of the `PromptKey` (policies/prompt_key.py `engine_keys`) and the prompt's length in the
request's routing view. The approximate index stays keyed on the text, as without a tokenizer.
Configured with `[tokenizer]` (off by default) and used only where it can pay: the policy reads
prompt keys and a worker publishes KV events (`Tokenizing.get`); otherwise nothing is tokenized.

Kinds:

- `emulator`: pd-gateway's engine emulator (emulator/tokenizer.py, copied here so the gateway
  runs without the emulator extra): BOS (id 1) first, then byte `b` of the UTF-8 text as id
  `b + 3`. Chats are rendered as its template does: `<|role|>\\ncontent\\n` per message (the
  text parts of a list content joined, other parts left out; no role: "user"), then
  `<|assistant|>\\n`, encoded like text. Exact for every prompt the emulator reads.
- `hf`: a HuggingFace `tokenizer.json` (the model's own, the `tokenizers` package: `pip install
  'pd-gateway[tokenizers]'`), encoded with `add_special_tokens=True`, as SGLang encodes a text
  prompt (its tokenizer manager calls the HF tokenizer's `encode(text)`, whose default adds
  them) and vLLM's `/v1/completions` does unless the request says `add_special_tokens: false`
  (vLLM 0.x `CompletionRequest.add_special_tokens`, default true). Chats are not tokenized:
  the gateway does not run the model's Jinja chat template, so a chat keeps its text key and
  the approximate index. Where a model's tokenizer_config.json changes the special tokens
  that tokenizer.json's post-processor adds (`add_bos_token`), the ids differ from the
  engine's: the index's outcome check then reports the worker misaligned and stops using it
  (gateway/kvevents/index.py), it never routes on the wrong ids silently.

  A long prompt is tokenized off the event loop: the `tokenizers` package holds the GIL in
  `encode` (20,000 tokens: ~34 ms during which the gateway serves nothing else) and releases it
  in `encode_batch`, so a text prompt of more than `offload_bytes` (default 4096) is encoded as
  a batch of one in a worker thread while the loop goes on (`bench/replay/tokenize_cost.py`
  measures the loop's longest stall both ways); shorter ones inline (a thread hop costs more).
  The `emulator` kind (~10 us for 20,000 tokens) is always inline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from gateway.config_base import _Section

# emulator/tokenizer.py: BOS_ID, BYTE_OFFSET
EMULATOR_BOS = 1
EMULATOR_BYTE_OFFSET = 3
_ADD_OFFSET = EMULATOR_BYTE_OFFSET.__add__
_FITS = bytes(range(256 - EMULATOR_BYTE_OFFSET))  # the bytes whose id fits a byte
_SHIFT = bytes((b + EMULATOR_BYTE_OFFSET) & 255 for b in range(256))
_BOS = bytes([EMULATOR_BOS])


class TokenizerConfig(_Section, frozen=True):
    """`[tokenizer]`: the routing tokenizer (module docstring); absent: none."""

    kind: Literal["emulator", "hf"]
    path: str | None = None  # hf: the model's tokenizer.json
    # hf: text prompts longer than this many bytes are tokenized in a worker thread (0: never)
    offload_bytes: int = 4096

    def __post_init__(self) -> None:
        if self.offload_bytes < 0:
            raise ValueError("tokenizer.offload_bytes must be >= 0")
        if self.kind == "hf" and not self.path:
            raise ValueError('tokenizer.path: kind = "hf" needs the model\'s tokenizer.json')
        if self.kind == "emulator" and self.path is not None:
            raise ValueError('tokenizer.path applies to kind = "hf" only')


class RoutingTokenizer(Protocol):
    kind: str

    def text_ids(self, text: bytes) -> Sequence[int]:
        """The ids of a completion's or /generate's text prompt (its UTF-8 bytes)."""
        ...

    def chat_ids(self, messages: Any, tools: Any) -> Sequence[int] | None:
        """The ids of a chat (decoded messages and tools); None where this kind cannot render
        it exactly."""
        ...


class EmulatorTokenizer:
    """The emulator's byte-level tokenizer (module docstring)."""

    kind = "emulator"

    def text_ids(self, text: bytes) -> Sequence[int]:
        # every id fits a byte (UTF-8 has no byte above 0xF4): the ids as bytes, made in C
        # (20,000 ids: ~10 us; as a tuple of ints, ~0.7 ms) and read as ints like a tuple's
        if not text.translate(None, _FITS):  # (no byte above 0xFC: checked in C)
            return _BOS + text.translate(_SHIFT)
        return (EMULATOR_BOS, *map(_ADD_OFFSET, text))

    def chat_ids(self, messages: Any, tools: Any) -> Sequence[int] | None:
        rendered = emulator_chat(messages)  # (its template leaves tools out)
        return None if rendered is None else self.text_ids(rendered.encode("utf-8", "surrogatepass"))


def emulator_chat(messages: Any) -> str | None:
    """emulator/tokenizer.py `render_chat`; None for content it would render with `str()`."""
    if not isinstance(messages, list):
        return None
    out: list[str] = []
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, Mapping) and p.get("type") == "text":
                    t = p.get("text", "")
                    if not isinstance(t, str):
                        return None
                    parts.append(t)
            text = "".join(parts)
        else:
            return None
        role = m.get("role", "user")
        if not isinstance(role, str):
            return None
        out.append(f"<|{role}|>\n{text}\n")
    out.append("<|assistant|>\n")
    return "".join(out)


def load_tokenizer_json(path: str, what: str) -> Any:
    """A HuggingFace `tokenizers.Tokenizer` read from `path` (a model's tokenizer.json); a
    ValueError naming `what` (the setting or flag that gave the path) when the `tokenizers`
    package is missing or the file cannot be loaded. Also the replay's prompt builder's."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - the extra is installed with dev
        raise ValueError(
            f"{what} needs the `tokenizers` package: pip install 'pd-gateway[tokenizers]'"
        ) from e
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types
        raise ValueError(f"{what} {path!r}: cannot load it: {e}") from None


class HfTokenizer:
    """A `tokenizers` JSON file, with the special tokens its post-processor adds."""

    kind = "hf"

    def __init__(self, path: str) -> None:
        self._tok = load_tokenizer_json(path, "tokenizer.path")
        self._encode: Callable[..., Any] = self._tok.encode
        self._batch: Callable[..., Any] = self._tok.encode_batch

    def text_ids(self, text: bytes) -> Sequence[int]:
        ids: list[int] = self._encode(text.decode("utf-8", "surrogatepass"), add_special_tokens=True).ids
        return ids

    def chat_ids(self, messages: Any, tools: Any) -> Sequence[int] | None:
        return None  # the chat template is not run here (module docstring)

    def text_ids_unlocked(self, text: bytes) -> Sequence[int]:
        """`text_ids`, releasing the GIL while it encodes (for a worker thread: module docstring)."""
        ids: list[int] = self._batch([text.decode("utf-8", "surrogatepass")], add_special_tokens=True)[0].ids
        return ids


def make_tokenizer(cfg: TokenizerConfig) -> RoutingTokenizer:
    """The configured tokenizer; ValueError when it cannot be loaded."""
    if cfg.kind == "hf":
        assert cfg.path is not None
        return HfTokenizer(cfg.path)
    return EmulatorTokenizer()


class Tokenizing:
    """Whether a request is tokenized: only while some worker publishes KV events (`sources`,
    the hub's subscriptions, which the admin API and discovery change at run time); and which
    text prompts are tokenized off the event loop (`offload_bytes`, an `hf` tokenizer's)."""

    __slots__ = ("_sources", "offload_bytes", "tokenizer")

    def __init__(
        self, tokenizer: RoutingTokenizer, sources: Callable[[], int], offload_bytes: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self._sources = sources
        self.offload_bytes = offload_bytes if isinstance(tokenizer, HfTokenizer) else 0

    def get(self) -> RoutingTokenizer | None:
        return self.tokenizer if self._sources() else None

    def offloads(self, text_bytes: int) -> HfTokenizer | None:
        """The tokenizer to run in a worker thread for a text prompt of `text_bytes` (None:
        inline, or not at all)."""
        tok = self.tokenizer
        limit = self.offload_bytes
        if limit and text_bytes > limit and isinstance(tok, HfTokenizer) and self._sources():
            return tok
        return None
