"""Build the tiny deterministic Llama model + tokenizer folder the e2e lanes serve (offline, no hub).

Test scaffolding for `make e2e-vllm` / `make e2e-sglang` (see tests/e2e/README.md): a random
`LlamaForCausalLM` (2 layers, hidden 256, 4 heads, 2 KV heads, head_dim 64, bf16, weights drawn with
std 0.08 so greedy outputs differ between prompts) and a byte-level BPE tokenizer (vocab 512) trained
on generated text, both from fixed seeds: the folder rebuilds byte-identical with the same library
versions. Greedy output is noise, but deterministic noise, which is all the e2e tests compare.

Runs with an engine's venv (it needs torch, transformers and tokenizers; the project's venv has
none of them):

    .venv-vllm/bin/python tools/build_tiny_model.py --out .cache/e2e/tiny-llama-vllm

The folder is rebuilt only when this script or the library versions change (a stamp file records
both); the build goes to a temporary folder that is renamed into place, so a crash leaves no
half-written model behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

SEED = 0
VOCAB_SIZE = 512
CONTEXT = 2048
STAMP = ".tiny-llama-stamp.json"

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the a of to and in is was for on that with as by at from it this be are or an have not which "
    "but all were when we there can more if will one about up out so what their time only into "
    "cache token prefill decode model server request stream block layer head vector engine queue "
    "river mountain window garden letter silver quiet morning orange planet engine bridge lantern "
    "capital france paris colour favourite story once upon king castle forest dragon ocean city"
).split()


def _corpus(rng: random.Random, n_lines: int = 400) -> list[str]:
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "!", "?", ",", ";"]))
    return lines


def _stamp(script: bytes) -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "script_sha256": hashlib.sha256(script).hexdigest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(random.Random(SEED)), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=CONTEXT,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


def _build_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_ids = json.loads((out / "tokenizer.json").read_text())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tok_ids}
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)
    # Draw every weight ourselves (not through transformers' init, which changes between versions):
    # normal(0, 0.08) for matrices, ones for the RMSNorm weights.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.08)
    model = model.to(torch.bfloat16)  # config.json then says "dtype": "bfloat16"
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers may write a generation_config.json with sampling defaults; the engines read it
    # for request defaults, so keep it plain (greedy comes from each request's temperature=0).
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]}, indent=2)
        + "\n"
    )


def build(out: Path, force: bool = False) -> bool:
    """Build into `out` unless an up-to-date build is there; returns True when it built."""
    stamp = _stamp(Path(__file__).read_bytes())
    stamp_file = out / STAMP
    if not force and stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return False
        except ValueError:
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    tmp.chmod(0o755)
    try:
        vocab = _build_tokenizer(tmp)
        _build_model(tmp, vocab)
        (tmp / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", type=Path, default=Path(".cache/e2e/tiny-llama"), help="model folder")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp matches")
    args = ap.parse_args(argv)
    built = build(args.out, force=args.force)
    print(f"tiny-llama {'built' if built else 'up to date'}: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
