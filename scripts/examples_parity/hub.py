"""What the Hub would give Accelerate's examples, built here without a network: a synthetic MRPC-like dataset
(sentence pairs, a label that depends on their word overlap, so a model can learn it), a word-level BERT
tokenizer over its vocabulary, a tiny randomly initialised BERT, and GLUE/MRPC's metric (accuracy and F1).
The data and vocabulary come from a fixed seed of their own; the model's weights come from torch's RNG at the
moment the example asks for it (after its `set_seed`), as a pretrained download would not, but the same on
both libraries."""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

WORDS = ("the cat dog sat ran on mat log a big small red blue house tree car road fast slow old new green "
         "sun moon sky day night river hill town city man woman child bird fish went saw made took").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SIZES = {"train": int(os.environ.get("EXAMPLES_PARITY_TRAIN", "192")),
         "validation": int(os.environ.get("EXAMPLES_PARITY_VALIDATION", "48"))}


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]


def mrpc_rows(split: str) -> dict[str, list]:
    """The columns of one split: idx, sentence1, sentence2, label (1 when the pair shares half its words)."""
    rng = random.Random(f"mrpc-{split}")
    rows: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for index in range(SIZES[split]):
        first = _sentence(rng)
        second = [w if rng.random() < 0.6 else rng.choice(WORDS) for w in first] if rng.random() < 0.5 else _sentence(rng)
        rows["sentence1"].append(" ".join(first))
        rows["sentence2"].append(" ".join(second))
        rows["label"].append(int(len(set(first) & set(second)) * 2 >= len(set(first))))
        rows["idx"].append(index)
    return rows


def tokenizer():
    """A BertTokenizerFast over WORDS (its vocabulary file written to a temporary folder)."""
    from transformers import BertTokenizerFast

    folder = Path(tempfile.mkdtemp(prefix="examples-parity-vocab-"))
    (folder / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    return BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)


def bert_for_classification(**kwargs):
    """A 2-layer, 32-wide BertForSequenceClassification with random weights (from torch's RNG now)."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(SPECIAL) + len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64, num_labels=2)
    return BertForSequenceClassification(config)
