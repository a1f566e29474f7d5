"""`calib run +method=sampleattention` end to end on a small structured Llama (no download)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from calib.errors import UserError
from calib.data.prompt import answer_token_ids
from calib.sampleattention.scoring import BucketEvaluator, PromptScore
from calib.sampleattention.tuning import GridPoint
from runtime_kernels.artifact import load_artifact
from runtime_kernels.sampleattention.api import SampleAttentionPrefill, bucket_table_tensor
from runtime_kernels.sampleattention.buckets import BucketTable
from tests.recipe_support import in_calib_home

ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}
LENGTHS, EDGE = (256, 512), 384
ALPHAS, CHUNK_NS = (0.3, 0.9), (1, 2)


def structured_llama(seed: int = 5) -> torch.nn.Module:
    """Random Llama with position-driven local heads of growing sharpness (random init is near uniform,
    so the masks would keep everything): one shared embedding offset makes keys mostly positional and
    query head ``h`` a multiple of its KV head's key projection."""
    from calib.data.tokenizer import build_tiny_backend
    from calib.models import random_model

    model = random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=seed)
    d = ARCH["head_dim"]
    with torch.no_grad():
        offset = torch.randn(ARCH["hidden_size"], generator=torch.Generator().manual_seed(seed))
        model.model.embed_tokens.weight += 0.04 * offset
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.v_proj.weight.mul_(30.0)
            for h, gain in enumerate((20.0, 60.0, 120.0, 200.0)):
                attn.q_proj.weight[h * d:(h + 1) * d] = gain * attn.k_proj.weight[(h // 2) * d:(h // 2 + 1) * d]
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from calib.data.tokenizer import save_tiny_tokenizer

    out = tmp_path_factory.mktemp("sa_llama")
    structured_llama().save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


def overrides(model_dir: Path, *extra: str) -> list[str]:
    arch = [f"model.arch.{k}={'null' if v is None else v}" for k, v in ARCH.items()]
    return ["+method=sampleattention", f"model.path={model_dir}", "model.name=rand-sa", *arch,
            f"model.lengths=[{LENGTHS[0]},{LENGTHS[1]}]", "device=cpu", "method.blk=32",
            f"method.bucket_edges=[{EDGE}]",
            f"method.alphas_c=[{ALPHAS[0]},{ALPHAS[1]}]", f"method.alphas_s=[{ALPHAS[0]},{ALPHAS[1]}]",
            f"method.chunk_ns=[{CHUNK_NS[0]},{CHUNK_NS[1]}]", "method.profiling.prompts_per_length=1",
            "data.tasks=[niah_single,kv_retrieval]", "method.min_relative_score=1.0", "method.table3_chunk_ns=null",
            *extra]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CALIB_HOME (MLflow SQLite + artifact store) for the module: creating the store costs seconds."""
    return tmp_path_factory.mktemp("home")


_in_home = in_calib_home


@pytest.fixture(scope="module")
def run(model_dir: Path, home: Path) -> dict[str, Any]:
    """One calibration (MLflow under a private CALIB_HOME); also returns the logged tuning record."""
    import mlflow

    import calib.run
    from calib.config import compose

    def calibrate_and_read() -> dict[str, Any]:
        result = calib.run.run(compose(overrides(model_dir, "method.report=full")))
        run_id = result["run_id"]
        return {"result": result,
                "tuning": mlflow.artifacts.load_dict(f"runs:/{run_id}/sampleattention/tuning.json"),
                "table3": mlflow.artifacts.load_text(f"runs:/{run_id}/sampleattention/table3.md"),
                "plots": [f.path for f in mlflow.MlflowClient().list_artifacts(run_id, "plots/sampleattention")]}

    out = _in_home(home, calibrate_and_read)
    json.dumps(out["result"])
    return out


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    from calib.config import compose
    from calib.models import load_model

    return load_model(compose(overrides(model_dir)).model, device="cpu")


def test_result_json_metrics_and_logged_files(run) -> None:
    result, tuning = run["result"], run["tuning"]
    assert result["model_uri"] == "models:/sampleattention-rand-sa/1"
    m = result["metrics"]
    assert m["grid_points"] == 2 * len(ALPHAS) ** 2 * len(CHUNK_NS)
    assert 0 < m["evaluated_points"] <= m["grid_points"]
    assert m["evaluated_points"] == sum(len(b["evaluated"]) for b in tuning["buckets"])
    for b in (0, 1):
        for key in ("dense_score", "score", "sparsity", "threshold", "evaluated_points"):
            assert f"bucket{b}.{key}" in m
        for n in CHUNK_NS:
            assert 0.0 <= m[f"table3.b{b}.n{n}.sparsity"] <= 1.0
    assert sorted(run["plots"]) == ["plots/sampleattention/bucket0.png", "plots/sampleattention/bucket1.png"]
    assert run["table3"].count("\n| 0 ") == 1 and "chunk_n=2" in run["table3"]


def test_default_report_tunes_the_same_rows_without_table3(run, model_dir: Path, home: Path) -> None:
    """``method.report=artifact`` (default): the same search and bucket table, no Table-3 rescoring."""
    import mlflow

    import calib.run
    from calib.config import compose

    def calibrate_and_list() -> tuple[dict[str, Any], list[str]]:
        result = calib.run.run(compose(overrides(model_dir)))
        return result, [f.path for f in mlflow.MlflowClient().list_artifacts(result["run_id"], "sampleattention")]

    result, files = _in_home(home, calibrate_and_list)
    assert "sampleattention/tuning.json" in files and "sampleattention/table3.md" not in files
    assert not [k for k in result["metrics"] if k.startswith("table3.")]
    full = load_artifact(run["result"]["artifact_dir"], method="sampleattention").manifest.payload["buckets"]
    mine = load_artifact(result["artifact_dir"], method="sampleattention").manifest.payload["buckets"]
    assert mine == full
    assert result["metrics"]["evaluated_points"] == run["result"]["metrics"]["evaluated_points"]


def test_chosen_point_is_feasible_and_the_sparsest_feasible(run) -> None:
    for bucket in run["tuning"]["buckets"]:
        assert bucket["num_prompts"] == 2 and bucket["threshold"] == 1.0  # min_relative_score, per task
        evaluated = bucket["evaluated"]
        assert len(evaluated) + len(bucket["skipped"]) == bucket["grid_points"]
        for e in evaluated:  # feasibility is the score rule; an early stop is always infeasible
            assert e["feasible"] == (e["score"] >= bucket["threshold"])
            assert e["complete"] or (not e["feasible"] and e["prompts_scored"] < 2)
        feasible = [e for e in evaluated if e["feasible"]]
        chosen = bucket["chosen"]
        if not feasible:
            assert chosen is None
            continue
        assert chosen["score"] >= bucket["threshold"] and chosen["complete"]
        assert chosen["sparsity"] >= max(e["sparsity"] for e in feasible) - 0.005


def test_table3_has_every_chunk_n_at_the_chosen_alphas_on_all_prompts(run) -> None:
    for bucket in run["tuning"]["buckets"]:
        t3 = bucket["table3"]
        assert [r["chunk_n"] for r in t3["rows"]] == list(CHUNK_NS)
        assert all(r["complete"] and r["prompts_scored"] == 2 for r in t3["rows"])
        assert all((r["alpha_c"], r["alpha_s"]) == (t3["alpha_c"], t3["alpha_s"]) for r in t3["rows"])
        if bucket["chosen"] is not None:
            assert (t3["alpha_c"], t3["alpha_s"]) == (bucket["chosen"]["alpha_c"], bucket["chosen"]["alpha_s"])
            mine = next(r for r in t3["rows"] if r["chunk_n"] == bucket["chosen"]["chunk_n"])
            assert mine["score"] == pytest.approx(bucket["chosen"]["score"])
        else:
            assert (t3["alpha_c"], t3["alpha_s"]) == (max(ALPHAS), max(ALPHAS))


def test_artifact_payload_and_tensor_round_trip(run) -> None:
    art = load_artifact(run["result"]["artifact_dir"], method="sampleattention")
    table = BucketTable.from_dict(art.manifest.payload["buckets"])
    assert table.edges == [EDGE] and table.blk == 32 and table.max_length == max(LENGTHS)
    assert table.to_dict() == art.manifest.payload["buckets"]
    assert torch.equal(art.tensor("table"), bucket_table_tensor(table))
    for row, bucket in zip(table.rows, run["tuning"]["buckets"]):
        chosen = bucket["chosen"]
        want = (1.0, 1.0, 1) if chosen is None else (chosen["alpha_c"], chosen["alpha_s"], chosen["chunk_n"])
        assert (row.alpha_c, row.alpha_s, row.chunk_n) == want
    assert art.manifest.data.count == 4 and art.manifest.data.lengths == list(LENGTHS)
    assert art.manifest.hyperparameters["score"] == "answer_prob"
    assert art.manifest.data.details["prompts_per_length"] == 1  # one count for every length, as configured
    assert art.manifest.hyperparameters["profiling"]["prompts_per_length"] == 1


def test_a_count_per_length_is_recorded_as_a_mapping(model_dir: Path, home: Path) -> None:
    """``prompts_per_length={256: 2, 512: 1}``: 2 and 1 prompts of each of the two tasks, in the buckets of
    their lengths; the manifest and the search record the mapping and the counts per bucket."""
    import mlflow

    import calib.run
    from calib.config import compose

    def calibrate_and_read() -> tuple[dict[str, Any], dict[str, Any]]:
        result = calib.run.run(compose(overrides(model_dir, "method.profiling.prompts_per_length={256:2,512:1}")))
        return result, mlflow.artifacts.load_dict(f"runs:/{result['run_id']}/sampleattention/tuning.json")

    result, tuning = _in_home(home, calibrate_and_read)
    manifest = load_artifact(result["artifact_dir"], method="sampleattention").manifest
    assert manifest.data.count == 2 * 2 + 2 * 1 and manifest.data.lengths == list(LENGTHS)
    assert manifest.data.details == {"purpose": "profiling", "prompts_per_length": {"256": 2, "512": 1},
                                     "prompts_per_bucket": {"0": 4, "1": 2}}
    assert manifest.hyperparameters["profiling"]["prompts_per_length"] == {"256": 2, "512": 1}
    assert [(b["lengths"], b["num_prompts"]) for b in tuning["buckets"]] == [([256], 4), ([512], 2)]
    assert manifest.payload["tuning"][0]["num_prompts"] == 4


def test_dense_score_matches_an_independent_teacher_forced_pass(run, loaded, model_dir: Path) -> None:
    """The dense answer probability, recomputed with ONE forward over prompt + answer."""
    from calib.config import compose
    from calib.evaluate import stop_token_ids
    from calib.sampleattention.recipe import Settings, _profiling_prompts

    cfg = compose(overrides(model_dir))
    prompts = _profiling_prompts(cfg, Settings.from_cfg(cfg), loaded.tokenizer)
    stops = sorted(stop_token_ids(loaded.tokenizer))
    per_length: dict[int, list[float]] = {}
    for p in prompts:
        ans = answer_token_ids(loaded.tokenizer, p)
        ids = torch.tensor([list(p.input_ids) + ans])
        with torch.no_grad():
            logp = torch.log_softmax(loaded.model(input_ids=ids).logits[0, len(p.input_ids) - 1:].double(), -1)
        terms = [float(logp[i, t]) for i, t in enumerate(ans)] + [float(torch.logsumexp(logp[-1, stops], 0))]
        per_length.setdefault(p.length, []).append(math.exp(sum(terms) / len(terms)))
    for bucket, length in zip(run["tuning"]["buckets"], LENGTHS):
        want = sum(per_length[length]) / len(per_length[length])
        assert bucket["dense_score"] == pytest.approx(want, rel=1e-4)


def test_contains_scored_prompts_get_no_stop_term(loaded, model_dir: Path) -> None:
    """A model that answers in a sentence (``contains`` scoring) is scored on the answer tokens alone:
    the geometric mean of their probabilities from one independent float64 forward, no stop term; an
    exact-match prompt of the same text keeps the stop term (a different, lower score here)."""
    from dataclasses import replace

    from calib.config import compose
    from calib.sampleattention.recipe import Settings, _profiling_prompts

    cfg = compose(overrides(model_dir))
    p = _profiling_prompts(cfg, Settings.from_cfg(cfg), loaded.tokenizer)[0]
    ans = answer_token_ids(loaded.tokenizer, p)
    ids = torch.tensor([list(p.input_ids) + ans])
    with torch.no_grad():
        logp = torch.log_softmax(loaded.model(input_ids=ids).logits[0, len(p.input_ids) - 1:].double(), -1)
    want = math.exp(sum(float(logp[i, t]) for i, t in enumerate(ans)) / len(ans))
    contains = replace(p, scoring="contains")
    exact = replace(p, scoring="exact_match")
    ev = BucketEvaluator(loaded, [contains, exact], blk=32)
    got_contains, got_exact = ev._score_prompt(0, None), ev._score_prompt(1, None)
    assert got_contains.score == pytest.approx(want, rel=1e-4)
    assert got_exact.score != pytest.approx(want, rel=1e-3)


def test_hf_apply_uses_the_tuned_rows(run, loaded) -> None:
    from runtime_kernels import hf

    art = load_artifact(run["result"]["artifact_dir"])
    rt = hf.apply(loaded.model, art, options={"sampleattention": {"stats": True}})
    try:
        assert isinstance(rt.prefill, SampleAttentionPrefill)
        ids = torch.arange(10, 10 + 450)[None]
        with torch.no_grad():
            logits = loaded.model(input_ids=ids, logits_to_keep=1).logits
        stats = rt.prefill.pop_stats()
    finally:
        hf.remove(loaded.model)
    assert torch.isfinite(logits).all() and stats["bucket"] == 1.0
    chosen = run["tuning"]["buckets"][1]["chosen"]
    assert (stats["sparsity"] > 0) == (chosen is not None and chosen["sparsity"] > 0)


def test_validate_rejects_bad_method_values(model_dir: Path) -> None:
    from calib.config import compose
    from calib.sampleattention.recipe import validate

    validate(compose(overrides(model_dir)))
    for bad, message in (("method.alphas_c=[0.5,1.2]", "method.alphas_c must list numbers in (0, 1]"),
                         ("method.chunk_ns=[0,2]", "method.chunk_ns must list integers >= 1"),
                         ("method.score=bleu", "method.score must be one of answer_prob, exact_match"),
                         ("method.bucket_edges=[512,384]",
                          "method.bucket_edges=[512, 384] must be strictly increasing"),
                         ("method.min_relative_score=1.5", "method.min_relative_score must be in (0, 1]"),
                         ("method.profiling.prompts_per_length=0", "method.profiling.prompts_per_length must be >= 1"),
                         ("method.report=some", "method.report must be one of artifact, full"),
                         ("method.table3_chunk_ns=[0]", "method.table3_chunk_ns must list integers >= 1"),
                         ("method.profiling.loop=graph", "method.profiling.loop must be one of auto, eager, static"),
                         ("method.profiling.batch_tokens=0", "method.profiling.batch_tokens must be >= 1"),
                         ("method.measure_time=sometimes", "method.measure_time must be one of auto, true, false")):
        with pytest.raises(UserError) as info:
            validate(compose(overrides(model_dir, bad)))
        assert message in str(info.value) and "\n" not in str(info.value), (bad, str(info.value))


# ------------------------------------------------------------------------------- early stop, no model
def test_early_stop_reports_an_upper_bound_below_the_threshold_and_full_rescores(loaded, monkeypatch) -> None:
    prompts = [type("P", (), {"text": "a", "answer": "b", "input_ids": [1, 2]})() for _ in range(4)]
    ev = BucketEvaluator(loaded, prompts, blk=32)
    values = iter([0.9, 0.3, 0.95, 0.97] * 2)
    calls: list[int] = []

    def fake(index: int, rt: Any) -> PromptScore:
        calls.append(index)
        return PromptScore(next(values), False, {"sparsity": 0.5})

    monkeypatch.setattr(ev, "_score_prompt", fake)
    ev.dense_scores, ev.threshold = [PromptScore(1.0, True, {})] * 4, 0.9  # one task, dense 1: score = mean
    point = GridPoint(0.5, 0.5, 1)
    stopped = ev.evaluate(point)  # after 0.9, 0.3: (1.2 + 2) / 4 = 0.8 < 0.9 -> failing whatever follows
    assert calls == [0, 1] and not stopped.complete and stopped.score == pytest.approx(0.8)
    assert ev(0.5, 0.5, 1).score == pytest.approx(0.8) and calls == [0, 1]  # cached
    full = ev.full(point)
    assert calls == [0, 1, 0, 1, 2, 3] and full.complete
    assert full.score == pytest.approx((0.9 + 0.3 + 0.95 + 0.97) / 4) and full.sparsity == 0.5


def _task_prompt(task: str) -> Any:
    return type("P", (), {"text": "a", "answer": "b", "input_ids": [1, 2], "task": task})()


def test_early_stop_decides_every_point_as_scoring_every_prompt_would(loaded) -> None:
    """On random per-prompt scores, tasks, dense scores and thresholds, the early-stopped evaluation is
    feasible exactly when every task's retention (sum of min(sparse, dense) over sum of dense, computed
    here directly) reaches the threshold, and a stopped score is an upper bound of the worst task's."""
    rng = np.random.default_rng(0)
    stopped_any = False
    for case in range(300):
        n = int(rng.integers(1, 9))
        scores = rng.integers(0, 9, n) / 8  # eighths: sums are exact, and ties with the threshold occur
        dense = rng.integers(0, 9, n) / 8
        tasks = [str(t) for t in rng.integers(0, 3, n)]
        threshold = float(rng.integers(1, 9) / 8)
        ev = BucketEvaluator(loaded, [_task_prompt(t) for t in tasks], blk=32)
        ev._score_prompt = lambda index, rt, values=dense: PromptScore(float(values[index]), False, {})
        ev.dense()  # reorders the prompts (dense-failures first): map each back to its own sparse score
        order = sorted(range(n), key=lambda i: dense[i])
        ev._score_prompt = lambda index, rt, o=order: PromptScore(float(scores[o[index]]), False, {})
        ev.threshold = threshold
        got = ev.evaluate(GridPoint(0.5, 0.5, 1))
        mine = {task: np.array([t == task for t in tasks]) for task in set(tasks)}
        ratios = [np.minimum(scores, dense)[m].sum() / dense[m].sum() for m in mine.values() if dense[m].sum() > 0]
        worst = min(ratios, default=1.0)
        assert (got.score >= threshold - 1e-12) == (worst >= threshold - 1e-12), (case, scores, dense, tasks)
        if got.complete:
            assert got.score == pytest.approx(worst)
        else:
            stopped_any = True
            assert worst <= got.score + 1e-12 < threshold
    assert stopped_any


def test_a_gain_on_one_task_does_not_hide_a_loss_on_another(loaded) -> None:
    """Hand-worked: task a keeps 3 of 4 (dense 2 of 4), task b 2 of 4 (dense 3 of 4). The mean (5/8)
    beats dense's (5/8 >= 0.99 x 5/8), but b keeps 2/3 of its dense score: the point fails at 0.99."""
    tasks = ["a"] * 4 + ["b"] * 4
    dense = [1, 1, 0, 0, 1, 1, 1, 0]
    sparse = [1, 1, 1, 0, 1, 1, 0, 0]
    ev = BucketEvaluator(loaded, [_task_prompt(t) for t in tasks], blk=32)
    ev._score_prompt = lambda index, rt: PromptScore(float(dense[index]), False, {})
    ev.dense()
    assert sorted(s.score for s in ev.dense_scores) == sorted(map(float, dense))
    order = sorted(range(8), key=lambda i: dense[i])  # dense() put the prompts in this order (answer_prob)
    ev._score_prompt = lambda index, rt: PromptScore(float(sparse[order[index]]), False, {})
    got = ev.full(GridPoint(0.5, 0.5, 1))
    assert got.mean == pytest.approx(5 / 8) and got.score == pytest.approx((2 / 4) / 0.75)
    ev.threshold = 0.99
    assert ev(0.6, 0.6, 1).score < 0.99


def test_a_gain_on_one_prompt_does_not_hide_a_loss_on_another_of_the_same_task(loaded) -> None:
    """Hand-worked, exact match on one task: dense answers prompts 0-2 of 4, the point answers 0, 1 and 3.
    Both means are 3/4, but the point kept 2 of dense's 3 answers: its score is 2/3 and it fails at 0.99;
    a point answering 0-3 keeps all 3 (score 1, its extra answer counts nothing)."""
    dense, flipped, extra = [1, 1, 1, 0], [1, 1, 0, 1], [1, 1, 1, 1]
    ev = BucketEvaluator(loaded, [_task_prompt("a") for _ in range(4)], blk=32, score="exact_match")
    ev._score_chunk = lambda chunk, rt: [PromptScore(float(dense[i]), bool(dense[i]), {}) for i in chunk]
    ev.dense()  # exact match: dense-correct prompts first, a stable sort: the order is unchanged
    assert [s.score for s in ev.dense_scores] == [1.0, 1.0, 1.0, 0.0]
    for point, sparse, expected in ((GridPoint(0.5, 0.5, 1), flipped, 2 / 3), (GridPoint(0.6, 0.6, 1), extra, 1.0)):
        ev._score_chunk = lambda chunk, rt, v=sparse: [PromptScore(float(v[i]), bool(v[i]), {}) for i in chunk]
        got = ev.full(point)
        assert got.mean == pytest.approx(sum(sparse) / 4) and got.score == pytest.approx(expected)
    ev.threshold = 0.99
    assert ev(0.5, 0.5, 1).score < 0.99 <= ev(0.6, 0.6, 1).score


def test_points_need_the_dense_reference_first(loaded) -> None:
    ev = BucketEvaluator(loaded, [_task_prompt("a")], blk=32)
    with pytest.raises(RuntimeError, match="dense"):
        ev.evaluate(GridPoint(0.5, 0.5, 1))


def test_static_exact_match_answers_in_batches_what_eager_answers_one_by_one(loaded, model_dir: Path,
                                                                            monkeypatch) -> None:
    """The serving-loop batches give every prompt the reply eager one-prompt generation gives it, under
    dense and under a sparse point, and the same sparsity (a batch's mean given to each of its prompts)."""
    import calib.sampleattention.scoring
    from calib.config import compose
    from calib.sampleattention.recipe import Settings, _profiling_prompts

    cfg = compose(overrides(model_dir, "method.profiling.prompts_per_length=3"))
    prompts = _profiling_prompts(cfg, Settings.from_cfg(cfg), loaded.tokenizer)
    replies: dict[str, list[str]] = {"eager": [], "static": []}
    evals = {}
    for loop in ("eager", "static"):
        def record(prediction: str, prompt: Any, loop: str = loop) -> bool:
            replies[loop].append(prediction)
            return len(prediction) % 2 == 0  # any deterministic rule: the same replies score the same

        monkeypatch.setattr(calib.sampleattention.scoring, "is_correct", record)
        ev = BucketEvaluator(loaded, prompts, blk=32, score="exact_match", max_new_tokens=6, loop=loop,
                             batch_tokens=4096)
        if loop == "static":
            assert max(map(len, ev._chunks())) > 1
        ev.dense()
        evals[loop] = ev.full(GridPoint(ALPHAS[0], ALPHAS[0], 1))
    assert len(replies["eager"]) == 2 * len(prompts) and any(replies["eager"])
    assert replies["static"] == replies["eager"]
    assert [s.score for s in evals["static"].scores] == [s.score for s in evals["eager"].scores]
    assert evals["eager"].sparsity > 0
    assert evals["static"].sparsity == pytest.approx(evals["eager"].sparsity, rel=1e-6)


def test_static_exact_match_stops_early_after_a_batch(loaded, monkeypatch) -> None:
    prompts = [type("P", (), {"text": "a", "answer": "b", "input_ids": [1, 2]})() for _ in range(6)]
    ev = BucketEvaluator(loaded, prompts, blk=32, score="exact_match", loop="static", batch_tokens=4)
    assert ev._chunks() == [[0, 1], [2, 3], [4, 5]]
    values = iter([1.0, 0.0, 0.0, 1.0, 1.0, 1.0] * 2)
    batches: list[int] = []

    def fake(batch: list[Any], rt: Any) -> list[tuple[float, bool]]:
        batches.append(len(batch))
        return [(v, v == 1.0) for v in (next(values) for _ in batch)]

    monkeypatch.setattr(ev, "_answer", fake)
    ev.dense_scores, ev.threshold = [PromptScore(1.0, True, {})] * 6, 0.7  # one task, dense 1: score = mean
    point = GridPoint(0.5, 0.5, 1)
    stopped = ev.evaluate(point)  # after 1, 0 the bound is 5/6 >= 0.7; after 0, 1 it is 4/6 < 0.7: stop
    assert batches == [2, 2] and not stopped.complete and stopped.score == pytest.approx(4 / 6)
    full = ev.full(point)
    assert batches == [2, 2, 2, 2, 2] and full.complete and full.score == pytest.approx(4 / 6)


def test_answer_token_ids_follow_the_prompt_as_the_model_writes_them() -> None:
    """The answer after one space, unless the prompt ends in whitespace or an opening quote: a chat
    model's answer prefix ends in a word (``… for lana is``) and its reply is `` 1234567``. A
    character-level stand-in tokenizer (every character one id) makes the separator visible."""
    from types import SimpleNamespace

    def chars(text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def ids(text: str, answer: str = "1234567") -> list[int]:
        return answer_token_ids(chars, SimpleNamespace(text=text, answer=answer))

    digits = [ord(c) for c in "1234567"]
    assert ids("The special magic number for lana is") == [ord(" ")] + digits
    assert ids("Question: what is the key?\nAnswer: ") == digits
    assert ids('The value of "key": "') == digits
    assert ids("anything", answer="") == []


def test_calib_eval_reports_sparsity_and_cra_per_task_and_length(run, model_dir: Path, home: Path) -> None:
    from calib.config import compose
    from calib.evaluate import evaluate

    cfg = compose(overrides(model_dir, f"artifact={run['result']['artifact_dir']}", "eval.num_prompts=1",
                            "eval.max_new_tokens=2", "eval.bootstrap=50"))
    out = _in_home(home, evaluate, cfg)
    json.dumps(out)
    for task in ("niah_single", "kv_retrieval"):
        for n in LENGTHS:
            assert set(out["tasks"][f"{task}@{n}"]) == {"dense", "sparse"}
            m = {k.split(".", 1)[1]: v for k, v in out["metrics"].items() if k.startswith(f"{task}@{n}.")}
            assert 0.0 <= m["sparsity"] <= 1.0 and 0.0 < m["cra_min"] <= m["cra"] <= 1.0
            assert m["bucket"] == float(n > EDGE)


# ------------------------------------------------------------------------------- held-out acceptance check
def test_acceptance_check_groups_held_out_prompts_by_bucket(run, model_dir: Path) -> None:
    from calib.config import compose
    from calib.sampleattention.acceptance import check

    cfg = compose(overrides(model_dir, f"artifact={run['result']['artifact_dir']}", "eval.num_prompts=1",
                            "eval.max_new_tokens=2", "eval.bootstrap=100"))
    out = check(cfg, min_prompts=1, max_drop=0.02)
    json.dumps(out)
    assert set(out["buckets"]) == {"0", "1"} and set(out["lengths"]) == {str(n) for n in LENGTHS}
    assert sum(b["n"] for b in out["buckets"].values()) == 4  # 2 tasks x 2 lengths x 1 prompt
    for b in out["buckets"].values():
        assert b["diff"] == pytest.approx(b["sparse_acc"] - b["dense_acc"]) and b["diff_ci_low"] <= b["diff"]
        assert 0.0 <= b["sparsity"] <= 1.0 and 0.0 < b["cra_min"] <= b["cra"] <= 1.0
    assert out["pass"] == (not out["reasons"])
    strict = check(cfg, min_prompts=100)
    assert not strict["pass"] and any("< 100" in r for r in strict["reasons"])


def test_verdict_rule() -> None:
    from calib.sampleattention.acceptance import verdict

    ok = {"n": 120.0, "diff_ci_low": -0.015, "sparsity": 0.0}
    good = {"0": ok, "1": {**ok, "sparsity": 0.3}}
    assert verdict(good, min_prompts=100, max_drop=0.02) == {"pass": True, "reasons": []}
    lossy = {**good, "1": {**ok, "diff_ci_low": -0.03, "sparsity": 0.3}}
    assert not verdict(lossy, min_prompts=100, max_drop=0.02)["pass"]
    assert not verdict({"0": {**ok, "sparsity": 0.3}, "1": ok}, min_prompts=100, max_drop=0.02)["pass"]  # longest dense
    assert not verdict({**good, "0": {**ok, "n": 99.0}}, min_prompts=100, max_drop=0.02)["pass"]


# ------------------------------------------------------------------------------- report helpers, no model
def test_heatmap_grid_labels_and_table3_markdown() -> None:
    from calib.sampleattention.report import BucketReport, _grid, heatmap_figure, table3_markdown
    from calib.sampleattention.scoring import PointEval
    from calib.sampleattention.tuning import EvaluatedPoint, SkippedPoint, TuningResult

    def ev(c: float, s: float, n: int, score: float, sparsity: float, complete: bool = True) -> PointEval:
        return PointEval(GridPoint(c, s, n), [PromptScore(score, True, {"sparsity": sparsity})], 1, score, complete)

    evals = {e.point: e for e in (ev(0.9, 0.8, 1, 0.99, 0.4), ev(0.8, 0.8, 1, 0.5, 0.6, complete=False),
                                  ev(0.9, 0.8, 2, 0.98, 0.35))}
    chosen = EvaluatedPoint(GridPoint(0.9, 0.8, 1), evals[GridPoint(0.9, 0.8, 1)].result(), True)
    skipped = [SkippedPoint(GridPoint(0.9, 0.9, 1), "dominates_feasible", GridPoint(0.9, 0.8, 1))]
    result = TuningResult(chosen, [chosen], skipped, 0.95)
    report = BucketReport(1, 1536, None, [2048], 1, 1.0, 1.0, 0.95, result, evals, (0.9, 0.8),
                          {1: evals[GridPoint(0.9, 0.8, 1)], 2: evals[GridPoint(0.9, 0.8, 2)]}, 8)
    grid = _grid(report, 1, [0.8, 0.9], [0.8, 0.9])
    assert grid["score"][1][0] == 0.99 and grid["sparsity"][0][0] == 0.6 and grid["labels"][0][0] == "<="
    assert grid["labels"][1][1] == "D" and math.isnan(grid["score"][1][1]) and math.isnan(grid["score"][0][1])
    fig = heatmap_figure(report, [0.8, 0.9], [0.8, 0.9])
    assert len(fig.axes) == 4  # chunk_n 1 and 2, score and sparsity each
    md = table3_markdown([report])
    assert "| 1 [1536,inf) | (0.90, 0.80) | 1.0000 | 0.9900 / 0.400* | 0.9800 / 0.350 |" in md


def test_report_full_scores_table3_chunk_ns_beyond_a_smaller_search(model_dir: Path, home: Path) -> None:
    """A search over fewer chunk_n (as the tiny model's default) still gets Table 3 over every
    ``table3_chunk_ns`` with ``method.report=full``; the bucket rows only use searched chunk_n."""
    import mlflow

    import calib.run
    from calib.config import compose

    def calibrate_and_read() -> tuple[dict[str, Any], dict[str, Any]]:
        result = calib.run.run(compose(overrides(model_dir, "method.report=full", f"method.chunk_ns=[{CHUNK_NS[0]}]",
                                                 f"method.table3_chunk_ns=[{CHUNK_NS[0]},{CHUNK_NS[1]}]")))
        return result, mlflow.artifacts.load_dict(f"runs:/{result['run_id']}/sampleattention/tuning.json")

    result, tuning = _in_home(home, calibrate_and_read)
    assert result["metrics"]["grid_points"] == 2 * len(ALPHAS) ** 2
    for bucket in tuning["buckets"]:
        assert [r["chunk_n"] for r in bucket["table3"]["rows"]] == list(CHUNK_NS)
        assert all(r["complete"] for r in bucket["table3"]["rows"])
    rows = load_artifact(result["artifact_dir"], method="sampleattention").manifest.payload["buckets"]["rows"]
    assert all(int(r["chunk_n"]) == CHUNK_NS[0] or float(r["alpha_c"]) == 1.0 for r in rows)
