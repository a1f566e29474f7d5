"""SAAP's per-layer ℓ profile (calib/saap/layer_profile.py): the greedy search against a hand-built
answer model whose losses are known, the settings' checks, and the config wiring."""

from __future__ import annotations

import logging

import pytest

from calib.config import compose
from calib.errors import UserError
from calib.saap.layer_profile import ProfileSettings, default_ladder, layer_groups, max_trials, search

LAYERS, C, TOP_L = list(range(1, 13)), 128, 8  # twelve sparse layers, groups of four: 1-4, 5-8, 9-12


class HandModel:
    """``dense`` correct answers, less ``loss[layer]`` for each layer whose ℓ is below ``need[layer]``;
    selectivity = the mean of ℓ / C over the layers. Counts its calls."""

    def __init__(self, dense: int, need: dict[int, int], loss: dict[int, int]) -> None:
        self.dense, self.need, self.loss, self.calls = dense, need, loss, []

    def __call__(self, setting: dict[int, int]) -> tuple[int, float]:
        self.calls.append(dict(setting))
        ell = {l: setting.get(l, TOP_L) for l in LAYERS}
        lost = sum(self.loss[l] for l, n in self.need.items() if ell[l] < n)
        return self.dense - lost, sum(min(1.0, v / C) for v in ell.values()) / len(LAYERS)


def settings(**kw) -> ProfileSettings:
    return ProfileSettings(**{"enabled": True, "group": 4, "max_groups": 2, "max_drop": 0.01, **kw})


def test_groups_and_default_ladder():
    assert layer_groups([3, 1, 2, 5, 4], 2) == [[1, 2], [3, 4], [5]]
    assert default_ladder(8, 128) == [16, 32, 64]
    assert default_ladder(16, 32) == [] and default_ladder(1, 5) == [2, 4]


def test_one_group_then_the_lowest_passing_rung():
    """Layers 6 and 7 need ℓ 64 and 32 (2 answers each): base 16/20 fails, group 5-8 at C restores all
    20, and the ladder 16, 32, 64 settles at 64 (at 32 layer 6 still loses its 2)."""
    model = HandModel(20, need={6: 64, 7: 32}, loss={6: 2, 7: 2})
    res = search(LAYERS, TOP_L, C, settings(), 20, 20, model)
    assert res.passed and res.top_l_layers == {5: 64, 6: 64, 7: 64, 8: 64}
    assert [t.step for t in res.trials] == ["base", "group 1-4", "group 5-8", "group 9-12", "ladder 16",
                                            "ladder 32", "ladder 64"]
    assert [t.correct for t in res.trials] == [16, 16, 20, 16, 16, 18, 20]
    assert len(model.calls) == len(res.trials)  # every setting answered once
    m = res.metrics()
    assert m["layer_profile.base_acc"] == 0.8 and m["layer_profile.acc"] == 1.0 and m["layer_profile.passed"] == 1
    assert m["layer_profile.selectivity"] == pytest.approx((8 * 8 + 4 * 64) / 12 / C)
    assert res.table()[-1] == {"step": "ladder 64", "top_l_layers": {"5": 64, "6": 64, "7": 64, "8": 64},
                               "acc": 1.0, "selectivity": pytest.approx((8 * 8 + 4 * 64) / 12 / C)}


def test_two_groups_ties_go_to_the_earlier_and_a_rung_that_never_passes():
    """Layers 2 and 10 need every bucket: groups 1-4 and 9-12 tie in round one (the earlier is taken),
    round two adds 9-12; no rung below C passes, so both groups stay at C."""
    model = HandModel(10, need={2: C, 10: C}, loss={2: 1, 10: 1})
    res = search(LAYERS, TOP_L, C, settings(max_drop=0.0), 10, 10, model)
    assert res.passed
    assert res.top_l_layers == {l: C for l in (1, 2, 3, 4, 9, 10, 11, 12)}
    assert [t.step for t in res.trials][:6] == ["base", "group 1-4", "group 5-8", "group 9-12", "group 5-8",
                                                "group 9-12"]
    assert res.trials[5].top_l_layers == {l: C for l in (1, 2, 3, 4, 9, 10, 11, 12)}
    assert len(res.trials) == 9  # base + 3 groups + the 2 left + rungs 16, 32, 64
    # the cost bound adds widening's bisection over 72, 80, ..., 120, 128 (8 values: 3 halvings + 1)
    assert max_trials(len(LAYERS), settings(max_drop=0.0), TOP_L, C) == 9 + 4
    # max_groups past the 3 groups: rounds of 3, 2 and 1; no rung strictly between ℓ = 8 and C = 128, so the
    # bisection runs over 16, 24, ..., 120, 128 (15 values: 4 halvings + 1)
    assert max_trials(len(LAYERS), settings(max_groups=5, ladder=[4, 8, 200]), TOP_L, C) == 1 + (3 + 2 + 1) + 0 + 5
    # rungs 16 and 100, then 108, 116, 124, 128 (2 halvings + 1)
    assert max_trials(len(LAYERS), settings(ladder=[16, 16, 100]), TOP_L, C) == 1 + (3 + 2) + 2 + 3


def test_no_rung_passes_so_widening_bisects_up_to_every_bucket(caplog):
    """Layers 2 and 10 need every bucket and one group may be raised: the rungs 16, 32, 64 fail, then the
    bisection over 72, 80, ..., 120, 128 tries 96, 112, 120 (all fail) and ends at C: every layer reads
    every bucket, which passes, and the run says the artifact reads every key."""
    model = HandModel(10, need={2: C, 10: C}, loss={2: 1, 10: 1})
    with caplog.at_level(logging.WARNING, logger="calib.saap.layer_profile"):
        res = search(LAYERS, TOP_L, C, settings(max_drop=0.0, max_groups=1), 10, 10, model)
    assert [t.step for t in res.trials][4:] == ["widen 16", "widen 32", "widen 64", "widen 96", "widen 112",
                                                "widen 120", "widen 128"]
    assert res.passed and res.top_l_layers == {l: C for l in LAYERS}
    assert res.metrics()["layer_profile.acc"] == 1.0 and res.metrics()["layer_profile.selectivity"] == 1.0
    assert "only ℓ = C (every bucket) in every sparse layer kept dense's answers" in caplog.text
    assert len(res.trials) <= max_trials(len(LAYERS), settings(max_drop=0.0, max_groups=1), TOP_L, C)


@pytest.mark.parametrize("need", [65, 72, 73, 100, 120, 121])
def test_widening_finds_the_smallest_passing_l_above_the_ladder(need, caplog):
    """Layers 2, 6 and 10 each need ℓ >= ``need`` (one answer each, groups raise one of them): the smallest
    passing value of 72, 80, ..., 128 is the first multiple of 8 above 64 that reaches ``need``, found by
    bisection within the cost bound, and the trials never answer a setting twice. The run says how many
    keys that reads."""
    model = HandModel(10, need={2: need, 6: need, 10: need}, loss={2: 1, 6: 1, 10: 1})
    with caplog.at_level(logging.WARNING, logger="calib.saap.layer_profile"):
        res = search(LAYERS, TOP_L, C, settings(max_drop=0.0, max_groups=1), 10, 10, model)
    smallest = next(v for v in range(72, C + 1, 8) if v >= need)  # the linear scan bisection must agree with
    assert res.passed and res.top_l_layers == {**{l: smallest for l in LAYERS}, **{l: C for l in (1, 2, 3, 4)}}
    if smallest < C:
        read = round(100 * (8 * smallest + 4 * C) / 12 / C)  # layers 5-12 at the widened ℓ, the raised group at C
        assert f"needed ℓ >= {smallest} of C = {C} in every sparse layer, reading {read} % of the keys" in caplog.text
    else:
        assert "only ℓ = C (every bucket)" in caplog.text
    assert len(res.trials) <= max_trials(len(LAYERS), settings(max_drop=0.0, max_groups=1), TOP_L, C)
    assert len({tuple(sorted(c.items())) for c in model.calls}) == len(model.calls)


def test_nothing_passes_even_at_every_bucket_keeps_the_best_and_warns(caplog):
    """An answer no ℓ saves (layer 3 would need more buckets than there are): widening reaches C and
    fails, so the most correct setting that reads the fewest keys, the base, is kept and the run warns."""
    model = HandModel(10, need={3: C + 1}, loss={3: 1})
    with caplog.at_level(logging.WARNING, logger="calib.saap.layer_profile"):
        res = search(LAYERS, TOP_L, C, settings(max_drop=0.0, max_groups=1), 10, 10, model)
    assert res.trials[-1].step == "widen 128" and res.trials[-1].correct == 9
    assert not res.passed and res.top_l_layers == {}
    assert res.metrics()["layer_profile.acc"] == 0.9 and res.metrics()["layer_profile.passed"] == 0
    assert "no setting within 1 groups and ℓ up to C = 128 kept dense's answers (9 of 10" in caplog.text


def test_widening_every_layer_passes_where_one_group_cannot():
    """Layers 2, 6 and 10 each need ℓ = 32 (one answer each), in three different groups: one raised group
    saves one answer (8/10), widening every layer to 16 saves none, to 32 all three."""
    model = HandModel(10, need={2: 32, 6: 32, 10: 32}, loss={2: 1, 6: 1, 10: 1})
    res = search(LAYERS, TOP_L, C, settings(max_drop=0.0, max_groups=1), 10, 10, model)
    assert [t.step for t in res.trials] == ["base", "group 1-4", "group 5-8", "group 9-12", "widen 16", "widen 32"]
    assert [t.correct for t in res.trials] == [7, 8, 8, 8, 8, 10]
    assert res.passed and res.top_l_layers == {**{l: 32 for l in LAYERS}, **{l: C for l in (1, 2, 3, 4)}}
    assert res.metrics()["layer_profile.passed"] == 1 and res.metrics()["layer_profile.acc"] == 1.0


@pytest.mark.parametrize("max_drop, passed", [(0.01, True), (0.0, False)])
def test_base_within_max_drop_changes_nothing(max_drop, passed):
    """Dense 100/100, ℓ everywhere 99: one answer of a hundred is within 1 %, not within 0."""
    model = HandModel(100, need={3: 16}, loss={3: 1})
    res = search(LAYERS, TOP_L, C, settings(max_drop=max_drop, ladder=[]), 100, 100, model)
    assert res.passed
    assert (res.top_l_layers == {}) is passed and len(res.trials) == (1 if passed else 4)


def test_explicit_ladder_keeps_rungs_between_top_l_and_c():
    model = HandModel(10, need={6: 64}, loss={6: 3})
    res = search(LAYERS, TOP_L, C, settings(ladder=[4, 64, 200, 8]), 10, 10, model)
    assert [t.step for t in res.trials][-1] == "ladder 64" and res.top_l_layers == {5: 64, 6: 64, 7: 64, 8: 64}


def profile_settings(*overrides: str) -> ProfileSettings:
    from calib.saap.recipe import Settings

    return Settings.from_cfg(compose(["+method=saap", *overrides])).profile


def test_settings_from_config_and_their_errors():
    tiny = profile_settings()
    assert not tiny.enabled and tiny.tasks is None and tiny.prompts == 96
    assert profile_settings("eval.batch_tokens=4096").batch_tokens == 4096  # follows eval's unless a model sets it
    smol = profile_settings("model=smollm2")  # on by default there, on the books' needles (its SAAP data)
    assert smol == ProfileSettings(enabled=True, tasks=["book_needle"], batch_tokens=65536)
    for bad, message in ((["method.layer_profile.group=0"], "method.layer_profile.group must be >= 1"),
                         (["method.layer_profile.batch_tokens=-1"], "batch_tokens must be >= 0"),
                         (["method.layer_profile.max_drop=1.5"], r"max_drop must be in \[0, 1\)"),
                         (["method.layer_profile.prompts=many"], "method.layer_profile.prompts must be an integer"),
                         (["method.layer_profile.tasks=niah_single"], "tasks must be a non-empty list of names")):
        with pytest.raises(UserError, match=message) as info:
            profile_settings(*bad)
        assert "\n" not in str(info.value)


def test_profile_tasks_must_be_tasks_the_data_generates():
    from calib.saap.recipe import validate

    validate(compose(["+method=saap", "model=smollm2"]))  # the books, profiled on their needles
    with pytest.raises(UserError, match=r"names \['book_needle'\], which data=synthetic does not generate") as info:
        validate(compose(["+method=saap", "model=smollm2", "data=synthetic"]))
    assert "\n" not in str(info.value)
    validate(compose(["+method=saap", "model=smollm2", "data=synthetic", "method.layer_profile.tasks=[niah_single]"]))


def test_data_needs_answers_only_when_profiling_rows_may_lack_them(tmp_path):
    from calib.saap.recipe import data_needs

    assert data_needs(compose(["+method=saap"]))["calibration"] is None
    on = data_needs(compose(["+method=saap", "method.layer_profile.enabled=true"]))  # profiles data.tasks
    assert "greedy answers" in on["calibration"]
    # generated prompts of named answered tasks always carry answers: the books' plain text is not profiled
    assert data_needs(compose(["+method=saap", "model=smollm2"]))["calibration"] is None
    assert "greedy answers" in data_needs(compose(["+method=saap", "model=smollm2",
                                                   "method.layer_profile.tasks=[book_text]"]))["calibration"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a b c", "answer": "1", "task": "t"}\n')
    on_file = compose(["+method=saap", "model=smollm2", "data=jsonl", f"data.path={rows}",
                       "method.layer_profile.tasks=[t]"])
    assert "greedy answers" in data_needs(on_file)["calibration"]  # file rows: checked


def test_profiling_prompts_skip_the_calibration_prompts_and_take_tasks_in_turn():
    from transformers import AutoTokenizer

    from calib.saap.layer_profile import profiling_prompts
    from tests.saap.test_teacher_forced import TINY

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    cfg = compose(["+method=saap", "data.tasks=[niah_single,kv_retrieval]"])
    ps = ProfileSettings(enabled=True, prompts=4, length=1024)
    first = profiling_prompts(cfg, ps, tokenizer)
    assert [p.task for p in first] == ["niah_single", "kv_retrieval"] * 2
    assert {p.length for p in first} == {1024} and all(p.answer for p in first)
    trained = {first[0].prompt_id, first[1].prompt_id}
    rest = profiling_prompts(cfg, ps, tokenizer, exclude=trained)
    assert len(rest) == 4 and not trained & {p.prompt_id for p in rest}
    assert [p.prompt_id for p in rest[:2]] == [first[2].prompt_id, first[3].prompt_id]  # the next of each task
