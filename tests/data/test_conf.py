"""Every data config composes, carries the keys the checks set, and feeds build_prompts."""

from __future__ import annotations

import pytest

from calib.config import compose
from calib.data import build_prompts


@pytest.mark.parametrize("option", ["synthetic", "jsonl", "hf"])
def test_data_options_compose(option):
    cfg = compose([f"data={option}", "data.num_prompts=2", "data.seed=5", "data.lengths=[256]",
                   "data.tasks=[kv_retrieval]"])
    assert cfg.data.source == option
    assert (cfg.data.num_prompts, cfg.data.seed, list(cfg.data.lengths), list(cfg.data.tasks)) == \
           (2, 5, [256], ["kv_retrieval"])


def test_synthetic_defaults(tiny_tokenizer):
    cfg = compose([])
    assert cfg.data.source == "synthetic"
    assert list(cfg.data.lengths) == list(cfg.model.lengths)
    assert len(cfg.data.tasks) == 5 and cfg.data.num_prompts == 4 and cfg.data.seed == 1234
    prompts = build_prompts(cfg.data, tiny_tokenizer, lengths=[256], num_prompts=1)
    assert [p.task for p in prompts] == list(cfg.data.tasks)
