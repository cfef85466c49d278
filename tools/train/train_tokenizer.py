"""Trains the family's byte-level BPE tokenizer on the stdlib training files.

Special ids follow Llama's: <unk> 0, <s> 1, </s> 2 (the tutorials' requests send
end_id 2 and pad_id 2). Saved as a `PreTrainedTokenizerFast` directory that
`AutoTokenizer.from_pretrained(dir)` loads offline.

    python tools/train/train_tokenizer.py --out checkpoints/base --vocab-size 2048
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import list_sources, read_text  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>"]


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    train_files, _ = list_sources()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator((read_text(p) for p in train_files), trainer=trainer)
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    # Llama convention: a BOS is prepended, no EOS appended.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab-size", type=int, default=2048)
    args = ap.parse_args()
    tokenizer = train_tokenizer(args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    print(f"tokenizer: {len(tokenizer)} tokens -> {args.out}")


if __name__ == "__main__":
    main()
