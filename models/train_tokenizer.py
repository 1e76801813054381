"""Train the byte-level BPE tokenizer of the default model (colibri-tiny).

Owns: models/tokenizer/tokenizer.json and tokenizer_config.json, trained with the `tokenizers` library on the
training split that models/data.py writes (the held-out split is never seen). chat_template.jinja in the same
folder is written by hand and only copied into tokenizer_config.json here.

Usage: python models/train_tokenizer.py [--corpus models/build/corpus] [--vocab 6144]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic merges, and a shared machine

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizer"
BOS = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"]


def corpus_texts(path: Path):
    with open(path) as f:
        for line in f:
            yield json.loads(line)["text"]


def train(corpus: Path, vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts(corpus / "train.jsonl"), trainer=trainer)
    return tokenizer


def tokenizer_config(chat_template: str) -> dict:
    added = {
        str(i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": "<|end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=HERE / "build" / "corpus")
    parser.add_argument("--vocab", type=int, default=6144)
    args = parser.parse_args()
    tokenizer = train(args.corpus, args.vocab)
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, tok
    OUT.mkdir(exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    chat_template = (OUT / "chat_template.jinja").read_text()
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(chat_template), indent=2) + "\n")
    print(f"vocab {tokenizer.get_vocab_size()} -> {OUT}")


if __name__ == "__main__":
    main()
