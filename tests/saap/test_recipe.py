"""`calib run +method=saap` end to end on a small random Llama: artifact, runtime, report, validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from calib.errors import UserError
from tests.recipe_support import run_recipe

ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}
C, WINDOW, TOP_L = 8, 32, 8  # top_l = C: every bucket visited, so decode must equal dense attention
METHODS = ("saap", "saap_per_head", "kmeans_derope", "kmeans_rope", "kmeans_derope_group", "kmeans_rope_group",
           "window")  # method.report=full, baseline_probe: both (the default)


def overrides(model_dir: Path, *extra: str) -> list[str]:
    arch = [f"model.arch.{k}={'null' if v is None else v}" for k, v in ARCH.items()]
    return ["+method=saap", f"model.path={model_dir}", "model.name=rand-saap", *arch, "model.lengths=[256,384]",
            "device=cpu", "data.tasks=[niah_single,kv_retrieval]", f"method.clusters={C}", f"method.window={WINDOW}",
            "method.long_range=64", f"method.top_l={TOP_L}", "method.top_l_layers=null", "method.iterations=5", "method.prompts=3",
            "method.top_ls=[1,2,4,8]", "method.classifier.hidden=32", "method.classifier.steps=30",
            "method.classifier.batch=64", "method.classifier.queries_per_prompt=48",
            "method.classifier.query_candidates=null", "method.eval.prompts=2", "method.eval.queries_per_prompt=24",
            *extra]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
    from calib.models import random_model

    out = tmp_path_factory.mktemp("saap_llama")
    random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=3).save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def result(model_dir: Path, home: Path) -> dict[str, Any]:
    """One ``calib.run.run`` for the module (the full report), its MLflow stores under ``home``."""
    return run_recipe(home, overrides(model_dir, "method.report=full"))


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    from calib.config import compose
    from calib.models import load_model

    return load_model(compose(overrides(model_dir)).model, device="cpu")


def test_result_metrics_and_artifact(result):
    from runtime_kernels.artifact import load_artifact

    assert result["model_uri"] == "models:/saap-rand-saap/1"
    m = result["metrics"]
    for t in ("0.02", "0.05", "0.1"):
        for method in METHODS:
            assert f"recall_at_sel{t}.{method}" in m, (t, method)
            assert 0.0 <= m[f"recall_at_sel{t}.{method}"] <= 1.0 + 1e-6
    for method in METHODS[:-1]:
        assert f"at_top_l.selectivity.{method}" in m and f"at_top_l.recall.{method}" in m
    lr, sr = m["by_query_range.long_range.fraction"], m["by_query_range.short_range.fraction"]
    assert lr + sr == pytest.approx(1.0) and 0 < sr
    assert any(k.startswith("by_query_range.short_range.recall_at_sel0.05.") for k in m)
    for stage in ("collect", "kmeans", "targets", "classifier", "eval"):
        assert m[f"time_{stage}_s"] > 0
    art = load_artifact(result["artifact_dir"], method="saap")
    hp = art.manifest.hyperparameters
    assert (hp["sink"], hp["window"], hp["top_l"], hp["dense_layers"], hp["clusters"]) == (1, WINDOW, TOP_L, [0], C)
    assert hp["top_l_layers"] == {}
    assert not any(k.startswith("layers.0.") for k in art.tensors)  # layer 0 is dense
    shapes = {k: tuple(v.shape) for k, v in art.tensors.items()}
    # one classifier per KV head (the default): ARCH's 2 KV heads, not its 4 query heads
    assert shapes["layers.1.centroids"] == (2, C, 16) and shapes["layers.1.w1"] == (2, 16, 32)
    assert shapes["layers.1.w2"] == (2, 32, C) and shapes["layers.1.bn_var"] == (2, 32)
    assert hp["classifier"]["heads"] == "kv"
    assert art.manifest.data.count == 3 and art.manifest.data.lengths == [384]


def test_eval_table_invariants(result):
    """Window = selectivity 0; ℓ ≥ C visits every key (recall 1, no error); selectivity grows with ℓ."""
    from runtime_kernels.artifact import load_artifact

    rows = load_artifact(result["artifact_dir"]).manifest.payload["eval_table"]
    window = next(r for r in rows if r["method"] == "window")
    assert window["selectivity"] == 0.0 and 0 < window["recall"] < 1
    for method in METHODS[:-1]:
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["l"])
        assert [r["l"] for r in mine] == [1, 2, 4, 8]
        sel = [r["selectivity"] for r in mine]
        assert sel == sorted(sel) and sel[-1] == pytest.approx(1.0)
        assert mine[-1]["recall"] == pytest.approx(1.0, abs=1e-5) and mine[-1]["rel_error"] < 1e-4
        assert mine[-1]["selectivity_with_window"] == pytest.approx(1.0)
        assert all(r["recall"] >= window["recall"] - 1e-6 for r in mine)


def test_registry_alias_and_mlflow_logs(result, home):
    import mlflow

    from calib import tracking

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CALIB_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.delenv("MLFLOW_REGISTRY_URI", raising=False)
        target = tracking.resolve_target()
        tracking.configure(target)
        # explicit URIs: the global client state may belong to an earlier test's store
        client = mlflow.MlflowClient(tracking_uri=target.tracking_uri, registry_uri=target.registry_uri)
        assert str(client.get_model_version_by_alias("saap-rand-saap", "candidate").version) == "1"
        run = client.get_run(result["run_id"])
        assert "recall_at_sel0.05.saap" in run.data.metrics and "time_eval_s" in run.data.metrics
        history = client.get_metric_history(result["run_id"], "classifier_loss.layer1")
        assert len(history) == 30 and history[-1].value < history[0].value
        files = {f.path for f in client.list_artifacts(result["run_id"], "plots")}
        assert {"plots/saap_recall_vs_selectivity.png", "plots/saap_error_vs_selectivity.png",
                "plots/saap_classifier_loss.png"} <= files


def _decode_logits(model: Any, ids: torch.Tensor, forced: list[int]) -> torch.Tensor:
    """Logits of the prefill's last position and of each decode step fed ``forced`` tokens: ``[1 + n, V]``."""
    from runtime_kernels.generate import cache_argument, output_cache

    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past, logits = output_cache(out), [out.logits[0, -1]]
        for tok in forced:
            out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{cache_argument(model): past})
            past = output_cache(out)
            logits.append(out.logits[0, -1])
    return torch.stack(logits)


def test_apply_visiting_every_bucket_equals_dense(result, loaded):
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.saap.api import SaapDecode
    from tests.runtime.saap.through_buckets import SaapThroughBuckets

    model = loaded.model
    ids = torch.randint(20, 200, (1, 150), generator=torch.Generator().manual_seed(0))
    forced = [5, 17, 42, 99]
    dense = _decode_logits(model, ids, forced)
    state = hf.apply(model, result["artifact_dir"])
    try:  # ℓ = C: the runtime serves dense attention, no index
        assert isinstance(state.decode, SaapDecode) and state.decode.top_l == TOP_L
        served = _decode_logits(model, ids, forced)
        assert not state.decode.index and state.decode.reads_every_key(1)
    finally:
        hf.remove(model)
    torch.testing.assert_close(served, dense, atol=1e-6, rtol=1e-6)
    # the artifact's index and kernel, through every bucket, give dense attention too
    through = SaapThroughBuckets.from_artifact(load_artifact(result["artifact_dir"], method="saap"), model)
    hf.attach(model, decode=through)
    try:
        sparse = _decode_logits(model, ids, forced)
        assert 1 in through.index and through.index[1].length == 150 + len(forced)
    finally:
        hf.remove(model)
    torch.testing.assert_close(sparse, dense, atol=2e-4, rtol=1e-4)
    # one bucket of C (the runtime option that `calib eval eval.top_l=1` passes): the decode steps change
    state = hf.apply(model, load_artifact(result["artifact_dir"], method="saap"), options={"saap": {"top_l": 1}})
    try:
        assert state.decode.top_l == 1
        few = _decode_logits(model, ids, forced)
    finally:
        hf.remove(model)
    torch.testing.assert_close(few[0], dense[0], atol=2e-4, rtol=1e-4)
    assert (few[1:] - dense[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("options, message", [
    ({"saap": {"top_l": 0}}, "top_l must be >= 1"),
    ({"saap": {"window": 5}}, "does not take the options \\['window'\\]"),
    ({"sale": {"theta": 0.1}}, "runtime options for sale, but no such artifact"),
    ({"saap": {"ranking": "mass"}}, "does not take the options \\['ranking'\\]"),  # mass is the only rule
])
def test_apply_refuses_bad_runtime_options(result, loaded, options, message):
    from runtime_kernels import hf
    from runtime_kernels.errors import ArtifactError

    with pytest.raises(ArtifactError, match=message):
        hf.apply(loaded.model, result["artifact_dir"], options=options)
    assert getattr(loaded.model, "calib_attention", None) is None  # refused before anything is attached


def test_eval_top_l_is_a_saap_option():
    from omegaconf import OmegaConf

    from calib.evaluate import runtime_options

    cfg = OmegaConf.create({"eval": {"top_l": 16}})
    assert runtime_options(cfg, "saap") == {"saap": {"top_l": 16}}
    assert runtime_options(OmegaConf.create({"eval": {"top_l": None}}), "sale") == {}
    with pytest.raises(UserError, match="SAAP setting"):
        runtime_options(cfg, "sale")
    with pytest.raises(UserError, match=">= 1"):
        runtime_options(OmegaConf.create({"eval": {"top_l": 0}}), "saap")
    per_layer = OmegaConf.create({"eval": {"top_l": None, "top_l_layers": {3: 192, "1": 8}}})
    assert runtime_options(per_layer, "saap") == {"saap": {"top_l_layers": {3: 192, 1: 8}}}
    with pytest.raises(UserError, match="eval.top_l_layers is a SAAP setting"):
        runtime_options(per_layer, "sale")
    for bad in ({3: 0}, {-1: 4}, {"x": 4}):
        with pytest.raises(UserError, match="eval.top_l_layers"):
            runtime_options(OmegaConf.create({"eval": {"top_l_layers": bad}}), "saap")


def test_eval_runtime_counts_saap_in_the_static_loop(result, loaded):
    """``calib eval``'s SAAP runtime (``with_statistics``: counted, SAAP at every length) in the static
    loop (CPU: no graphs): every bucket visited answers as the eager loop does, selectivity 1 in both;
    one bucket counts a selectivity strictly inside (0, 1) for every prompt. The prompts reach a second
    view (the static index ends at view - bucket = 256 keys: shorter prompts decode densely)."""
    from types import SimpleNamespace

    from calib.evaluate import answer_prompts, with_statistics
    from runtime_kernels import hf

    gen = torch.Generator().manual_seed(11)
    prompts = [SimpleNamespace(task="t", length=n, answer="", scoring="contains",
                               input_ids=torch.randint(20, 200, (n,), generator=gen).tolist()) for n in (300, 300, 350)]
    answers = {}
    for top_l in (C, 1):
        options = with_statistics({"saap": {"top_l": top_l}}, "saap")
        state = hf.apply(loaded.model, result["artifact_dir"], options=options, serve="method")
        assert state.decode.stats and state.serve == "method"
        try:
            answers[top_l] = {loop: answer_prompts(loaded, prompts, 5, state, batch_tokens=1000, loop=loop)
                              for loop in ("eager", "static")}
        finally:
            hf.remove(loaded.model)
    every = answers[C]
    assert [r.prediction for r in every["static"]] == [r.prediction for r in every["eager"]]
    for r in every["static"] + every["eager"]:
        assert r.stats == pytest.approx({"selectivity": 1.0, "selectivity_with_window": 1.0})
    for r in answers[1]["static"]:
        assert 0.0 < r.stats["selectivity"] < r.stats["selectivity_with_window"] < 1.0


def test_per_layer_default_l_is_written_and_applied(model_dir, loaded, tmp_path):
    """``method.top_l_layers``: the artifact carries the per-layer ℓ, the runtime applies it by default and
    the headline ``at_top_l`` metrics are read at it. ℓ = 1 everywhere but C on layer 1 (the only
    sparse layer): every bucket visited, so decode equals dense attention and ``at_top_l`` equals the
    ℓ = C column of the table."""
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact

    res = run_recipe(tmp_path, overrides(model_dir, "method.top_l=1", f"method.top_l_layers={{1: {C}}}"))
    manifest = load_artifact(res["artifact_dir"], method="saap").manifest
    # the default report (artifact): SAAP and the window only, no k-means baselines or oracles
    assert {r["method"] for r in manifest.payload["eval_table"]} == {"saap", "window"}
    assert not [k for k in res["metrics"] if any(b in k for b in ("kmeans_derope", "kmeans_rope", "oracle_",
                                                                   "saap_per_head"))]
    assert "recall_at_sel0.05.saap" in res["metrics"] and manifest.hyperparameters["report"] == "artifact"
    hp = manifest.hyperparameters
    assert hp["top_l"] == 1 and hp["top_l_layers"] == {"1": C} and C in hp["top_ls"]
    saap = {r["l"]: r for r in manifest.payload["eval_table"] if r["method"] == "saap"}
    assert saap[1]["selectivity"] < 1.0 and saap[C]["selectivity"] == pytest.approx(1.0)  # C: every candidate
    for k in ("selectivity", "recall", "rel_error"):
        assert res["metrics"][f"at_top_l.{k}.saap"] == pytest.approx(saap[C][k])
    model = loaded.model
    ids = torch.randint(20, 200, (1, 150), generator=torch.Generator().manual_seed(1))
    dense = _decode_logits(model, ids, [5, 17, 42])
    state = hf.apply(model, res["artifact_dir"])
    try:
        assert state.decode.top_l == 1 and state.decode.layer_top_l(1) == C
        from calib.evaluate import runtime_settings

        assert runtime_settings(state) == {"top_l": 1, "top_l_layers": {1: C}}
        sparse = _decode_logits(model, ids, [5, 17, 42])
    finally:
        hf.remove(model)
    torch.testing.assert_close(sparse, dense, atol=2e-4, rtol=1e-4)


def test_one_classifier_per_query_head_is_trained_written_and_served(model_dir, loaded, tmp_path):
    """``method.classifier.heads=query``: the artifact holds one classifier per query head, the runtime
    sums the group's outputs per KV head (ℓ = C: decode equals dense attention; ℓ = 1: it reads a
    fraction of the keys), and the report's table has every ℓ."""
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.saap import SaapDecode

    res = run_recipe(tmp_path, overrides(model_dir, "method.classifier.heads=query"))
    art = load_artifact(res["artifact_dir"], method="saap")
    assert art.manifest.hyperparameters["classifier"]["heads"] == "query"
    layer = SaapDecode.from_artifact(art, loaded.model).layers[1]
    assert layer.w1.shape[0] == ARCH["num_heads"] and layer.w2.shape == (ARCH["num_heads"], 32, C)
    saap = {r["l"]: r for r in art.manifest.payload["eval_table"] if r["method"] == "saap"}
    assert saap[C]["selectivity"] == pytest.approx(1.0) and saap[1]["selectivity"] < 1.0
    model = loaded.model
    ids = torch.randint(20, 200, (1, 150), generator=torch.Generator().manual_seed(1))
    dense = _decode_logits(model, ids, [5, 17, 42])
    hf.apply(model, res["artifact_dir"])  # the artifact's ℓ = C
    try:
        sparse = _decode_logits(model, ids, [5, 17, 42])
    finally:
        hf.remove(model)
    torch.testing.assert_close(sparse, dense, atol=2e-4, rtol=1e-4)


def test_foreign_model_is_refused(result):
    from calib.data.tokenizer import build_tiny_backend
    from calib.models import random_model
    from runtime_kernels import hf
    from runtime_kernels.errors import ArtifactError

    other = random_model("llama", {**ARCH, "num_layers": 3, "vocab_size": build_tiny_backend().get_vocab_size()})
    with pytest.raises(ArtifactError, match="calibrated for model 'rand-saap'"):
        hf.apply(other, result["artifact_dir"])


@pytest.mark.parametrize("extra, message", [
    (["method.clusters=1"], "method.clusters must be >= 2"),
    (["method.window=1"], "method.window must be > method.sink"),
    (["method.sink=-1"], "method.sink must be >= 0"),
    (["method.top_l=0"], "method.top_l must be >= 1"),
    (["method.long_range=-5"], "method.long_range must be >= 0"),
    (["method.iterations=0"], "method.iterations must be >= 1"),
    (["method.clusters=abc"], "method.clusters must be an integer"),
    (["method.dense_layers=[0,1]"], "covers every layer"),
    (["method.dense_layers=[5]"], "out of range"),
    (["method.kmeans.backend=sklearn"], "method.kmeans.backend must be one of auto, faiss, torch"),
    (["method.classifier.lr=0"], "method.classifier.lr must be > 0"),
    (["method.prompts=2.5"], "method.prompts must be an integer"),
    (["method.causal_targets=1"], "method.causal_targets must be true or false"),
    (["~method.classifier.hidden"], "method.classifier.hidden is not set"),
    (["method.top_l_layers={1: 0}"], "method.top_l_layers needs layers >= 0 and ℓ >= 1"),
    (["method.top_l_layers={0: 4}"], "method.top_l_layers names dense layers \\[0\\]"),
    (["method.top_l_layers={2: 4}"], "method.top_l_layers names layers \\[2\\] out of range"),
    (["method.top_l_layers=[1,2]"], "method.top_l_layers must map layer numbers to ℓ"),
    (["method.eval.baseline_probe=all"], "method.eval.baseline_probe must be one of head, group, both"),
    (["method.report=some"], "method.report must be one of artifact, full"),
    (["method.classifier.heads=all"], "method.classifier.heads must be one of query, kv"),
])
def test_validate_errors(model_dir, extra, message):
    from calib.config import compose
    from calib.saap.recipe import validate

    with pytest.raises(UserError, match=message) as info:
        validate(compose(overrides(model_dir, *extra)))
    assert "\n" not in str(info.value)


def test_validate_accepts_defaults(model_dir):
    from calib.config import compose
    from calib.saap.recipe import validate

    validate(compose(overrides(model_dir)))
    validate(compose(["+method=saap"]))  # the tiny model's defaults


def test_eval_batches_of_equal_length_answer_as_one_prompt_at_a_time(result, loaded):
    """``calib eval``'s batching (prompts of one token count, no padding) gives every prompt the answer it
    gets alone, with SAAP at one bucket of C (sparse) attached; the stats are the batch's means."""
    from types import SimpleNamespace

    from calib.evaluate import answer_prompts
    from runtime_kernels import hf

    gen = torch.Generator().manual_seed(5)
    prompts = [SimpleNamespace(task="t", length=n, answer="", scoring="exact_match",
                               input_ids=torch.randint(20, 200, (n,), generator=gen).tolist())
               for n in (140, 140, 170, 140, 170)]
    state = hf.apply(loaded.model, result["artifact_dir"], options={"saap": {"top_l": 1, "stats": True}})
    try:
        one = answer_prompts(loaded, prompts, 6, state, batch_tokens=0)
        batched = answer_prompts(loaded, prompts, 6, state, batch_tokens=450)  # batches [0, 1, 3] and [2, 4]
    finally:
        hf.remove(loaded.model)
    assert [r.prediction for r in batched] == [r.prediction for r in one]
    sel = [r.stats["selectivity"] for r in one]
    assert 0 < min(sel) and max(sel) < 1
    for members in ([0, 1, 3], [2, 4]):
        for i in members:
            assert batched[i].stats["selectivity"] == pytest.approx(sum(sel[j] for j in members) / len(members),
                                                                    rel=0.05)


@pytest.mark.parametrize("loop", ["eager", "static"])
def test_layer_profile_scorer_answers_like_dense_with_every_bucket(result, loaded, model_dir, loop):
    """The profile's scorer (calib/saap/layer_profile.py) on the calibrated runtime, in the eager loop and
    the serving loop that CUDA uses (CPU: no graphs): every bucket of the only sparse layer (ℓ = C)
    answers exactly as dense, at selectivity 1; ℓ = 1 reads fewer keys."""
    from calib.config import compose
    from calib.data import build_prompts
    from calib.evaluate import answer_prompts
    from calib.saap.layer_profile import AnswerScorer
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.saap import SaapDecode

    cfg = compose(overrides(model_dir))
    prompts = build_prompts(cfg.data, loaded.tokenizer, seed=int(cfg.data.seed), lengths=[320],
                            tasks=["niah_single"], num_prompts=3)  # past the first view: a static index of 256 keys
    per_layer = SaapDecode.from_artifact(load_artifact(result["artifact_dir"], method="saap"), loaded.model).layers
    scorer = AnswerScorer(loaded, prompts, per_layer, top_l=1, base_layers={}, max_new_tokens=6, batch_tokens=4096,
                          loop=loop)
    dense = answer_prompts(loaded, prompts, 6, batch_tokens=4096, loop=loop)
    every = scorer.answers({1: C})
    assert any(r.prediction for r in dense)
    assert [r.prediction for r in every] == [r.prediction for r in dense]
    assert all(r.stats["selectivity"] == pytest.approx(1.0) for r in every)
    correct, selectivity = scorer({})
    assert correct == sum(r.correct for r in scorer.answers({})) and 0 < selectivity < 1


def test_layer_profile_choice_reaches_the_artifact(model_dir, tmp_path, monkeypatch):
    """``method.layer_profile.enabled``: the stage runs between the classifiers and the report, and the
    ``{layer: ℓ}`` it returns is the artifact's per-layer ℓ, read by the report and logged. The search
    is replaced by one that answers with every bucket of layer 1 (on random weights every setting
    passes at once: the search itself is tested on known losses in test_layer_profile.py)."""
    from calib.saap import layer_profile
    from runtime_kernels.artifact import load_artifact

    def every_bucket(layers, top_l, clusters, ps, dense_correct, prompts, score):
        correct, selectivity = score({1: clusters})
        trial = layer_profile.Trial({1: clusters}, correct, selectivity, "group 1-1")
        return layer_profile.ProfileResult({1: clusters}, True, dense_correct, prompts, [trial])

    monkeypatch.setattr(layer_profile, "search", every_bucket)
    res = run_recipe(tmp_path, overrides(model_dir, "method.top_l=1", "method.layer_profile.enabled=true",
                                         "method.layer_profile.prompts=2", "method.layer_profile.length=256",
                                         "method.layer_profile.tasks=[niah_single]"))
    m = res["metrics"]
    assert m["time_layers_s"] > 0 and m["layer_profile.passed"] == 1 and m["layer_profile.layers_raised"] == 1
    assert m["layer_profile.selectivity"] == pytest.approx(1.0)
    assert m["at_top_l.selectivity.saap"] == pytest.approx(1.0)  # the report reads layer 1 at ℓ = C
    manifest = load_artifact(res["artifact_dir"], method="saap").manifest
    assert manifest.hyperparameters["top_l"] == 1 and manifest.hyperparameters["top_l_layers"] == {"1": C}
    assert manifest.payload["layer_profile"] == [{"step": "group 1-1", "top_l_layers": {"1": C},
                                                  "acc": m["layer_profile.acc"], "selectivity": pytest.approx(1.0)}]
    import mlflow

    from calib import tracking

    monkeypatch.setenv("CALIB_HOME", str(tmp_path))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    target = tracking.resolve_target()
    # explicit URIs: the global client state may belong to another test's store
    client = mlflow.MlflowClient(tracking_uri=target.tracking_uri, registry_uri=target.registry_uri)
    files = {f.path for f in client.list_artifacts(res["run_id"], "plots")}
    assert "plots/saap_layer_profile.png" in files
    logged = mlflow.artifacts.download_artifacts(run_id=res["run_id"], artifact_path="saap/layer_profile.json",
                                                 dst_path=str(tmp_path / "logged"), tracking_uri=target.tracking_uri)
    assert json.loads(Path(logged).read_text())["trials"] == manifest.payload["layer_profile"]
