"""A deterministic byte-level tokenizer.

Token ids: ``BOS_ID`` (1) starts every encoded prompt, ``EOS_ID`` (2) is never produced by the
emulated model (it always runs to ``max_tokens``, like ``ignore_eos``), and byte ``b`` is id
``b + BYTE_OFFSET``. The vocabulary therefore has ``VOCAB_SIZE`` = 259 entries.

Chat messages are rendered with a small fixed template (see :func:`render_chat`) and then
encoded like text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
BYTE_OFFSET = 3
VOCAB_SIZE = 256 + BYTE_OFFSET

_DECODE_TABLE: list[str] = ["", "", ""] + [chr(b) if 32 <= b < 127 else "" for b in range(256)]


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    """Text to token ids (one id per UTF-8 byte, plus BOS)."""
    ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
    if add_bos:
        ids.insert(0, BOS_ID)
    return ids


def decode(ids: Iterable[int]) -> str:
    """Token ids back to text; ids outside the byte range are dropped, bad UTF-8 is replaced."""
    data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < VOCAB_SIZE)
    return data.decode("utf-8", errors="replace")


def token_text(token_id: int) -> str:
    """The text of one token when it is a printable ASCII byte (the only ones the model emits)."""
    if 0 <= token_id < len(_DECODE_TABLE):
        return _DECODE_TABLE[token_id]
    return ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    return str(content)


def render_chat(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
    """The emulator's chat template: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``."""
    out = []
    for message in messages:
        role = str(message.get("role", "user"))
        out.append(f"<|{role}|>\n{_content_text(message.get('content'))}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)


def encode_chat(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    return encode(render_chat(messages))
