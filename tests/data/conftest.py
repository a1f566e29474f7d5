"""Tokenizers built inside the tests (nothing downloaded): the tiny word-level one, a small byte-level
BPE without BOS, and the same BPE with a Llama-3-style chat template that writes its own BOS."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}<|sep|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    from calib.data.tokenizer import load_tokenizer, save_tiny_tokenizer

    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok")))


def _train_bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from calib.data.synthetic import TASK_FUNCTIONS

    corpus = [TASK_FUNCTIONS[t](i, 60).context for t in TASK_FUNCTIONS for i in range(6)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|start|>", "<|sep|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="session")
def bpe_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=_train_bpe(), bos_token="<|bos|>", eos_token="<|eos|>",
                                   model_max_length=1 << 20)


@pytest.fixture(scope="session")
def chat_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=_train_bpe(), bos_token="<|bos|>", eos_token="<|eos|>",
                                  model_max_length=1 << 20)
    tok.chat_template = CHAT_TEMPLATE
    return tok
