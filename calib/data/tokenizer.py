"""The tiny model's tokenizer: a word-level WordPiece vocabulary over the synthetic tasks' words.

Built with the ``tokenizers`` library (no training: the vocabulary is the closed word set of
:mod:`calib.data.vocab`) and saved in the Hugging Face layout, so ``AutoTokenizer.from_pretrained(dir)``
loads it like any other model's tokenizer.

- Pre-tokenizer: BERT's (split on whitespace and on every punctuation character).
- Model: WordPiece over whole words; numbers split into single digits ``1 ##2 ##3`` so that a 7-digit
  number is 7 tokens and any number is representable. Unknown words become ``<unk>``.
- Post-processor: ``<s>`` prepended (BOS exactly once); decoder: WordPiece (joins ``##`` pieces, drops
  the space before ``. , ? !``), so a decoded answer reads ``1234567`` or ``kobe rulo``.
- Special tokens ``<s> </s> <unk> <pad>`` (ids 0-3). No chat template.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer

from calib.data.vocab import all_words

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
PUNCTUATION = tuple('.,:;?!"\'=(){}[]-+*/#&%$@<>_|~`^\\')
DIGITS = tuple("0123456789")
MODEL_MAX_LENGTH = 10240


def tiny_vocabulary() -> list[str]:
    """Token strings in id order: specials, digits, ``##`` digits, punctuation, words."""
    vocab = list(SPECIAL_TOKENS) + list(DIGITS) + [f"##{d}" for d in DIGITS] + list(PUNCTUATION)
    vocab += [w for w in all_words() if w not in vocab]
    return vocab


def build_tiny_backend():
    """The ``tokenizers.Tokenizer`` object (not yet wrapped for transformers)."""
    vocab = {tok: i for i, tok in enumerate(tiny_vocabulary())}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", continuing_subword_prefix="##",
                                     max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tiny_tokenizer(out_dir: str | Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tiny_backend().save(str(out / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out


def load_tokenizer(path: str | Path):
    """``transformers.AutoTokenizer.from_pretrained(path)`` (local files only)."""
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
