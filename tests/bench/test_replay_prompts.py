"""bench/replay prompts: shared blocks are the same tokens, lengths are exact, for the emulator's
tokenizer and for a real (`tokenizers`) one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.replay import prompts
from bench.replay.trace import Row
from emulator import model, tokenizer


def _row(length: int, ids: tuple[int, ...]) -> Row:
    return Row(0.0, length, 4, ids)


def test_byte_prompts_have_exactly_the_rows_length_in_emulator_tokens() -> None:
    b = prompts.PromptBuilder(prompts.ByteTokenizer())
    for length, ids in [
        (2, (0,)),
        (511, (0,)),
        (512, (0,)),
        (513, (0, 1)),
        (1024, (0, 1)),
        (40160, tuple(range(79))),
    ]:
        text = b.text(_row(length, ids))
        assert len(tokenizer.encode(text)) == length  # BOS + one token per byte
        b.check(_row(length, ids), text)


def test_rows_sharing_blocks_share_exactly_those_tokens() -> None:
    b = prompts.PromptBuilder(prompts.ByteTokenizer())
    a = tokenizer.encode(b.text(_row(2000, (7, 8, 9, 10))))
    c = tokenizer.encode(b.text(_row(1900, (7, 8, 11, 12))))
    assert a[:1024] == c[:1024]  # blocks 7 and 8, BOS included
    assert a[1024:1536] != c[1024:1536]  # block 9 vs block 11
    # the emulator's prefix cache (16-token chained block hashes) sees the same 64 blocks
    ha, hc = model.chain_hashes(a, 16), model.chain_hashes(c, 16)
    common = next(i for i, (x, y) in enumerate(zip(ha, hc, strict=False)) if x != y)
    assert common == 1024 // 16


def test_a_partial_last_block_is_a_prefix_of_the_whole_block() -> None:
    b = prompts.PromptBuilder(prompts.ByteTokenizer())
    short = b.text(_row(700, (1, 2)))
    full = b.text(_row(1024, (1, 2)))
    assert full.startswith(short)


def test_a_salt_changes_every_block() -> None:
    a = prompts.PromptBuilder(prompts.ByteTokenizer()).text(_row(600, (1, 2)))
    b = prompts.PromptBuilder(prompts.ByteTokenizer(), salt="run2").text(_row(600, (1, 2)))
    assert a[:100] != b[:100]


def test_too_few_blocks_or_no_room_for_text_is_refused() -> None:
    b = prompts.PromptBuilder(prompts.ByteTokenizer())
    with pytest.raises(prompts.LengthMismatch):
        b.text(_row(1025, (1, 2)))
    with pytest.raises(prompts.LengthMismatch):
        b.text(_row(1, (1,)))


def test_check_catches_a_tokenizer_that_counts_otherwise() -> None:
    class TwoBytes(prompts.ByteTokenizer):
        def count(self, text: str) -> int:
            return 2 * len(text)

    b = prompts.PromptBuilder(TwoBytes())
    row = _row(600, (1, 2))
    with pytest.raises(prompts.LengthMismatch, match="has 1199"):
        b.check(row, b.text(row))


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer (GPT-2/Llama-3 style pre-tokenizer), trained here."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>"], show_progress=False)
    corpus = [" ".join(prompts.CANDIDATE_WORDS[i:] + prompts.CANDIDATE_WORDS[:i]) for i in range(40)]
    tok.train_from_iterator(corpus * 5, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_a_real_tokenizer_gets_exact_lengths_and_shared_token_ids(bpe_file: Path) -> None:
    from tokenizers import Tokenizer

    hf = prompts.HFTokenizer(str(bpe_file))
    assert hf.special_tokens() == 1
    b = prompts.PromptBuilder(hf)
    tok = Tokenizer.from_file(str(bpe_file))
    ra, rc = _row(1300, (5, 6, 7)), _row(1100, (5, 6, 8))
    ta, tc = b.text(ra), b.text(rc)
    b.check(ra, ta)
    b.check(rc, tc)
    ia = tok.encode(ta).ids
    ic = tok.encode(tc).ids
    assert len(ia) == 1300 and len(ic) == 1100
    assert ia[:1024] == ic[:1024]
    assert ia[1024:1100] != ic[1024:1100]
    # block boundaries hold: the prompt's ids are its blocks' ids end to end
    pieces = b.pieces(ra)
    joined = tok.encode(pieces[0]).ids + [
        i for p in pieces[1:] for i in tok.encode(p, add_special_tokens=False).ids
    ]
    assert joined == ia


def test_the_engines_tokenize_endpoint_builds_the_same_exact_prompts(bpe_file: Path) -> None:
    """`--tokenize-url`: POST /tokenize in vLLM's shape ({"model", "prompt", "add_special_tokens"}
    -> {"count", "max_model_len", "tokens"}, vllm/entrypoints/openai/protocol.py), served here by
    the same tokenizer as the file; the prompts and their checks must come out the same."""
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_file))
    seen: list[dict[str, object]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            req = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(req)
            ids = tok.encode(req["prompt"], add_special_tokens=req.get("add_special_tokens", True)).ids
            body = _json.dumps({"count": len(ids), "max_model_len": 8192, "tokens": ids}).encode()
            self.send_response(200 if self.path == "/tokenize" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = prompts.RemoteTokenizer(f"http://127.0.0.1:{server.server_address[1]}", "m")
        local = prompts.PromptBuilder(prompts.HFTokenizer(str(bpe_file)))
        b = prompts.PromptBuilder(remote)
        row = _row(1500, (3, 4, 5))
        text = b.text(row)
        b.check(row, text)
        assert text == local.text(row)
        assert seen[0]["model"] == "m" and seen[0]["add_special_tokens"] is True
    finally:
        server.shutdown()
