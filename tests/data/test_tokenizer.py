"""The tiny model's tokenizer: HF-loadable, small, closed over the synthetic vocabulary."""

from __future__ import annotations

import json

from calib.data.tokenizer import SPECIAL_TOKENS, save_tiny_tokenizer, tiny_vocabulary
from calib.data.vocab import name_pool


def test_files_and_specials(tmp_path):
    from transformers import AutoTokenizer

    out = save_tiny_tokenizer(tmp_path / "tok")
    assert {p.name for p in out.iterdir()} == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert [tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token] == ["<s>", "</s>", "<unk>", "<pad>"]
    assert [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id] == [0, 1, 2, 3]
    assert tok.chat_template is None
    assert len(tok) == len(tiny_vocabulary()) <= 4096
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 10240


def test_vocabulary_is_deterministic():
    vocab = tiny_vocabulary()
    assert vocab == tiny_vocabulary()
    assert vocab[: len(SPECIAL_TOKENS)] == list(SPECIAL_TOKENS)
    assert len(set(vocab)) == len(vocab)


def test_encoding(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = tok("The special magic number for kobe is 1234567.")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[-8:] == ["1", "##2", "##3", "##4", "##5", "##6", "##7", "."]
    assert tok.decode(tok("1234567", add_special_tokens=False)["input_ids"]) == "1234567"
    a, b = name_pool()[:2]
    words = tok(f'"{a}": "{b}"', add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(words) == ['"', a, '"', ":", '"', b, '"']
    assert tok("zzzq", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    assert tok.decode([*tok(f"{a} {b}", add_special_tokens=False)["input_ids"], tok.eos_token_id],
                      skip_special_tokens=True) == f"{a} {b}"


def test_shipped_tokenizer_is_current():
    """artifacts/models/tiny holds the tokenizer the code builds (rebuild: scripts/build_tiny_tokenizer.py)."""
    import pytest

    from calib.paths import project_root

    shipped = project_root() / "artifacts" / "models" / "tiny" / "tokenizer.json"
    if not shipped.exists():
        pytest.skip("no shipped tiny model")
    vocab = json.loads(shipped.read_text())["model"]["vocab"]
    assert sorted(vocab, key=vocab.get) == tiny_vocabulary()
