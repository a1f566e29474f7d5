"""``calib eval`` answers several data sources side by side (a real model: synthetic tasks and books)."""

from __future__ import annotations

import mlflow
import pytest

from calib.config import compose
from calib.errors import UserError
from calib.evaluate import eval_suites, suite_config, suite_headlines
from calib.registry import eval_tags


@pytest.mark.parametrize("overrides, suites", [
    ([], ["synthetic"]),                                           # tiny lists no eval_suites: data alone
    (["model=smollm2"], ["synthetic", "books"]),                   # a real model: both, side by side
    (["model=smollm2", "data=books"], ["synthetic", "books"]),     # data is one of the model's suites
    (["model=smollm2", "data=jsonl", "data.path=x.jsonl"], ["jsonl"]),  # the user's own data: that alone
    (["eval.suites=[books]"], ["books"]),                          # named explicitly
])
def test_which_suites_eval_answers(overrides, suites):
    assert eval_suites(compose(overrides)) == suites


def test_an_unknown_suite_is_one_line():
    with pytest.raises(UserError, match="eval.suites names 'pg19'"):
        eval_suites(compose(["eval.suites=[synthetic,pg19]"]))


def test_a_suite_config_follows_its_own_tasks_and_keeps_the_runs_own_data():
    cfg = compose(["model=smollm2", "data.num_prompts=7"])
    books = suite_config(cfg, "books")
    assert books.data.source == "books" and list(books.eval.tasks) == list(books.data.tasks)
    assert "book_needle" in books.eval.tasks and books.data.scoring == "contains"  # the model's rule
    assert suite_config(cfg, "synthetic").data.num_prompts == 7  # the run's own data, overrides kept


def test_suite_headlines_and_version_tags_per_suite():
    metrics = {"suite.books.diff": -0.1, "suite.books.diff_ci_low": -0.2, "suite.books.diff_ci_high": 0.0,
               "suite.books.dense_acc": 0.9, "suite.synthetic.diff": 0.0, "diff": -0.05}
    heads = suite_headlines(metrics, ["synthetic", "books"])
    assert heads == {"summary/books.acc_delta": -0.1, "summary/books.acc_delta_ci_low": -0.2,
                     "summary/books.acc_delta_ci_high": 0.0, "summary/books.acc_dense": 0.9,
                     "summary/synthetic.acc_delta": 0.0}
    tags = eval_tags({"summary/acc_delta": -0.05, **heads}, seed=1, num_prompts=10, run_id="r")
    assert tags["eval.books.ci_low"] == "-0.2000" and tags["eval.books.acc_delta"] == "-0.1000"
    assert tags["eval.synthetic.acc_delta"] == "0.0000" and tags["eval.acc_delta"] == "-0.0500"


def test_eval_reports_both_suites_on_the_embedded_model(tmp_path, monkeypatch):
    """Dense eval of tiny on the synthetic tasks and the held-out books at 512 tokens: every cell of
    both suites, and each suite's pooled accuracy equals the mean of its own prompts."""
    from calib.evaluate import evaluate

    monkeypatch.setenv("CALIB_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = compose(["eval.suites=[synthetic,books]", "model.lengths=[512]", "eval.num_prompts=2",
                   "data.tasks=[niah_single]", "eval.max_new_tokens=4", "device=cpu"])
    try:
        result = evaluate(cfg)
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run()
    book_tasks = ("book_needle", "book_needle_word", "book_needle_phrase", "book_multineedle")
    assert set(result["tasks"]) == {"niah_single@512", *(f"{t}@512" for t in book_tasks)}
    m = result["metrics"]
    assert m["suite.synthetic.dense_acc"] == result["tasks"]["niah_single@512"]["dense"]
    books = [result["tasks"][f"{t}@512"]["dense"] for t in book_tasks]
    assert m["suite.books.dense_acc"] == pytest.approx(sum(books) / len(books))
    assert m["num_prompts"] == 2 + 2 * len(book_tasks)


def test_eval_counts_statistics_that_serving_leaves_off():
    from calib.evaluate import with_statistics

    for method in ("saap", "sale", "sampleattention", "santa"):
        assert with_statistics({}, method) == {method: {"stats": True}}
    assert with_statistics({"santa": {"budget": 64}}, "santa") == {"santa": {"budget": 64, "stats": True}}
