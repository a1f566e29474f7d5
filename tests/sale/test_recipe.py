"""`calib run +method=sale` end to end on a small structured Llama: artifact, acceptance bound, runtime, theta."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from calib.errors import UserError
from runtime_kernels.artifact import load_artifact
from tests.recipe_support import run_recipe
from tests.sale.conftest import sale_overrides

THETA_LOW, THETA_HIGH = 0.003, 0.03
CALIB_LENGTH = 512


def _calibrate(home: Path, model_dir: Path, theta: float, *extra: str) -> dict[str, Any]:
    """``calib.run.run`` with the MLflow stores under ``home``."""
    return run_recipe(home, sale_overrides(model_dir, theta, *extra))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One CALIB_HOME (MLflow SQLite + artifact store) for the module: creating the store costs seconds."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def low_run(sale_model_dir: Path, home: Path) -> dict[str, Any]:
    return _calibrate(home, sale_model_dir, THETA_LOW, "method.report=full", "method.theta_curve=[0.5,10]")


@pytest.fixture(scope="module")
def loaded(sale_model_dir: Path):
    from calib.config import compose
    from calib.models import load_model

    cfg = compose(sale_overrides(sale_model_dir, THETA_LOW))
    return load_model(cfg.model, device="cpu")


def test_result_json_and_artifact(low_run):
    assert low_run["model_uri"] == "models:/sale-rand-sale/1"
    m = low_run["metrics"]
    for key in ("sparsity", "err_worst", "dense_head_fraction", "sparsity_at_384", "sparsity_at_512",
                "ablation.tau_shared", "ablation.err_worst_per_head", "ablation.err_worst_shared",
                "ablation.acc_dense", "ablation.acc_per_head", "ablation.acc_shared", "sparsity_vs_theta.0.003"):
        assert key in m, key
    assert 0.0 < m["sparsity"] < 1.0 and m["bound_met"] == 1.0
    art = load_artifact(low_run["artifact_dir"], method="sale")
    tau, err, density = art.tensor("tau"), art.tensor("err"), art.tensor("density")
    assert tau.shape == (2, 4) and err.shape == (3, 2, 4) and density.shape == (2, 4)
    assert tau.dtype == err.dtype == density.dtype == torch.float32
    man = art.manifest
    assert man.payload["precision"] == "int4" and man.payload["selection"]["bits"] == 4
    assert man.hyperparameters["theta"] == THETA_LOW and man.hyperparameters["calib_length"] == CALIB_LENGTH
    assert man.data.count == 3 and man.data.lengths == [CALIB_LENGTH]
    # heads are calibrated one by one: on this model the sharpest heads need smaller thresholds than the rest
    assert len(set(tau.flatten().tolist())) > 1
    assert m["sparsity"] == pytest.approx(float(1 - density.mean()), abs=1e-6)


def test_ablation_worst_errors_match_the_stored_tensor(low_run):
    m, art = low_run["metrics"], load_artifact(low_run["artifact_dir"])
    assert m["ablation.err_worst_per_head"] == pytest.approx(float(art.tensor("err").max()), rel=1e-6)
    assert m["ablation.err_worst_per_head"] <= THETA_LOW
    # equal mean sparsity: the shared tau's measured sparsity is the per-head one within the grid step
    assert m["ablation.sparsity_shared"] == pytest.approx(m["ablation.sparsity_per_head"], abs=0.03)
    assert m["ablation.sparsity_shared"] == pytest.approx(m["ablation.sparsity_shared_predicted"], abs=1e-6)


def _calibration_prompts(cfg, art, tokenizer) -> list:
    from calib.data import build_prompts

    ids = art.manifest.data.details["prompt_ids"]
    pool = build_prompts(cfg.data, tokenizer, seed=art.manifest.data.seed, lengths=[CALIB_LENGTH],
                         num_prompts=len(ids))
    by_id = {p.prompt_id: p for p in pool}
    return [by_id[i] for i in ids]


def _independent_errors(loaded, prompts, tau: torch.Tensor, sel) -> torch.Tensor:
    """Err ``[S, L, H]`` recomputed from scratch: float64 dense causal attention vs float64 block-sparse
    attention on the Selection-Pass mask at ``tau: [L, H]`` (selection on the model's own float32 q, k)."""
    from calib.collect.capture import run_layer_callbacks
    from runtime_kernels.blocksparse.reference import block_sparse_attention, dense_causal_attention
    from runtime_kernels.sale.api import sale_select

    out = torch.zeros(len(prompts), tau.shape[0], tau.shape[1], dtype=torch.float64)

    def on_layer(cap) -> None:
        q, k, v = cap.q_post[None], cap.k_post[None], cap.v[None]
        mask = sale_select(q, k, tau[cap.layer], config=sel, backend="reference")
        dense = dense_causal_attention(q.double(), k.double(), v.double())
        sparse = block_sparse_attention(q.double(), k.double(), v.double(), mask)
        out[cap.prompt_index, cap.layer] = (dense - sparse).abs().sum((-1, -2))[0] / q.shape[2]

    run_layer_callbacks(loaded, [p.input_ids for p in prompts], on_layer, progress=False)
    return out


def test_acceptance_every_sample_meets_theta_and_tau_is_the_first_that_does(low_run, loaded, sale_model_dir):
    """The acceptance check: recompute Err at each stored tau on the same samples, compare with theta;
    and each head's tau is the FIRST ladder value that passes (twice its tau fails on some sample)."""
    from calib.config import compose
    from runtime_kernels.sale.reference import SaleSelectionConfig

    art = load_artifact(low_run["artifact_dir"])
    tau, stored = art.tensor("tau"), art.tensor("err").double()
    sel_dict = {k: v for k, v in art.manifest.payload["selection"].items() if k != "precision"}
    sel = SaleSelectionConfig(**sel_dict)
    prompts = _calibration_prompts(compose(sale_overrides(sale_model_dir, THETA_LOW)), art, loaded.tokenizer)
    err = _independent_errors(loaded, prompts, tau, sel)
    torch.testing.assert_close(err, stored, atol=1e-5, rtol=1e-3)
    sparse_heads = (tau > 0)[None].expand_as(err)
    assert bool((err[sparse_heads] <= THETA_LOW + 1e-6).all()), err.amax(0)
    # minimality: at 2*tau (or, for a dense head, at the last ladder value tau_min < t) some sample fails
    ladder = art.manifest.payload["ladder"]
    above = torch.where(tau > 0, 2 * tau, torch.full_like(tau, ladder[-2]))
    checked = tau < ladder[0]
    err_above = _independent_errors(loaded, prompts, torch.where(checked, above, tau), sel)
    assert bool((err_above.amax(0)[checked] > THETA_LOW - 1e-6).all())
    assert int(checked.sum()) >= 2  # the model really makes several heads halve


def test_apply_is_exactly_dense_at_tau_zero_and_close_otherwise(low_run, loaded, tmp_path):
    from runtime_kernels import hf
    from runtime_kernels.manifest import write_artifact

    art = load_artifact(low_run["artifact_dir"])
    ids = torch.tensor([list(range(5, 5 + 400))])
    with torch.no_grad():
        dense = loaded.model(input_ids=ids).logits
    zero = {"thresholds": {"tau": torch.zeros_like(art.tensor("tau")), "err": art.tensor("err"),
                           "density": torch.ones_like(art.tensor("density"))}}
    zero_dir = write_artifact(tmp_path / "zero", dataclasses.replace(art.manifest), zero)
    try:
        rt = hf.apply(loaded.model, zero_dir, options={"sale": {"stats": True}})
        with torch.no_grad():
            same = loaded.model(input_ids=ids).logits
        zero_stats = rt.prefill.pop_stats()
    finally:
        hf.remove(loaded.model)
    assert torch.equal(same, dense)
    assert zero_stats == {"density": 1.0, "sparsity": 0.0}
    try:
        rt = hf.apply(loaded.model, art, options={"sale": {"stats": True}})
        with torch.no_grad():
            sparse = loaded.model(input_ids=ids).logits
        stats = rt.prefill.pop_stats()
    finally:
        hf.remove(loaded.model)
    assert not torch.equal(sparse, dense)
    assert (sparse - dense).abs().max() < 0.05 * dense.abs().max()
    assert 0.0 < stats["sparsity"] < 1.0 and stats["density"] == pytest.approx(1 - stats["sparsity"])
    assert rt.prefill.pop_stats() == {}  # popped: nothing since


def test_larger_theta_gives_at_least_the_sparsity(low_run, sale_model_dir, home):
    high = _calibrate(home, sale_model_dir, THETA_HIGH, "model.lengths=[512]")
    assert high["model_uri"] == "models:/sale-rand-sale/2"  # a new version of the same registered model
    assert high["metrics"]["sparsity"] >= low_run["metrics"]["sparsity"]
    assert high["metrics"]["sparsity"] > low_run["metrics"]["sparsity"]  # this model: strictly
    lo, hi = load_artifact(low_run["artifact_dir"]), load_artifact(high["artifact_dir"])
    assert bool((hi.tensor("tau") >= lo.tensor("tau")).all())
    # the default report (artifact): no shared-tau ablation, sparsity by length or theta curve
    assert not [k for k in high["metrics"] if k.startswith(("ablation.", "sparsity_at_", "sparsity_vs_theta."))]
    assert "time_sparsity_by_length_s" not in high["metrics"]
    # the run's own what-if curve (theta x theta_curve on the same samples) is monotone and agrees with
    # the second run at THETA_HIGH = 10 x THETA_LOW
    curve = {float(k.split(".", 1)[1]): v for k, v in low_run["metrics"].items() if k.startswith("sparsity_vs_theta.")}
    assert len(curve) == 3 and [curve[t] for t in sorted(curve)] == sorted(curve.values())
    assert curve[THETA_HIGH] == pytest.approx(high["metrics"]["sparsity"], abs=1e-6)


def test_eval_reports_dense_vs_sale_accuracy_and_sparsity_per_length(low_run, sale_model_dir, home):
    """`calib eval artifact=<dir>`: both accuracies per task@length and SALE's achieved block sparsity."""
    import mlflow

    from calib.config import compose
    from calib.evaluate import evaluate

    cfg = compose(sale_overrides(sale_model_dir, THETA_LOW, f"artifact={low_run['artifact_dir']}",
                                 "eval.num_prompts=1", "eval.tasks=[niah_single]"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CALIB_HOME", str(home))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        try:
            result = evaluate(cfg)
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()
    assert set(result["tasks"]) == {"niah_single@384", "niah_single@512"}
    assert all(set(v) == {"dense", "sparse"} for v in result["tasks"].values())
    m = result["metrics"]
    assert 0.0 < m["niah_single@512.sparsity"] < 1.0
    assert m["niah_single@512.density"] == pytest.approx(1 - m["niah_single@512.sparsity"])


@pytest.mark.parametrize("override, needle", [
    ("method.theta=0", "method.theta must be > 0"),
    ("method.theta=-1", "method.theta must be > 0"),
    ("method.bits=3", "method.bits must be one of 4, 8"),
    ("method.block_q=0", "method.block_q must be >= 1"),
    ("method.block_k=0", "method.block_k must be >= 1"),
    ("method.num_samples=0", "method.num_samples must be >= 1"),
    ("method.sink=-1", "method.sink must be >= 0"),
    ("method.tau0=2", "method.tau0 must be in (0, 1]"),
    ("method.tau_min=0.01", "method.tau_min must be in [0, 0.008)"),
    ("method.calib_tasks=[]", "method.calib_tasks must be a non-empty list of names or null"),
    ("method.theta_curve=[0.5,-1]", "method.theta_curve must list numbers > 0"),
    ("method.compare_shared_tau=yes", "method.compare_shared_tau must be true or false"),
    ("method.calib_length=0", "method.calib_length must be >= 1"),
    ("method.theta=abc", "method.theta must be a number"),
    ("method.report=some", "method.report must be one of artifact, full"),
], ids=lambda x: x if "=" in str(x) else "")
def test_validate_rejects_bad_values_in_one_line(sale_model_dir, override, needle):
    from calib.config import compose
    from calib.sale.recipe import validate

    cfg = compose(sale_overrides(sale_model_dir, THETA_LOW, override))
    with pytest.raises(UserError) as info:
        validate(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_validate_accepts_the_shipped_config(sale_model_dir):
    from calib.config import compose
    from calib.sale.recipe import validate

    validate(compose(["+method=sale"]))
    validate(compose(["+method=sale", "model=llama31", "method.bits=8"]))
    validate(compose(sale_overrides(sale_model_dir, THETA_LOW)))


def test_eval_static_loop_gives_the_eager_answers_and_stats(low_run, loaded):
    """``eval.loop=static`` (the serving loop; on CPU without graphs) answers as the eager loop does with
    SALE attached: the same prefill runs (so the same sparsity), then dense decode steps."""
    from types import SimpleNamespace

    from calib.evaluate import answer_prompts
    from runtime_kernels import hf

    gen = torch.Generator().manual_seed(9)
    prompts = [SimpleNamespace(task="t", length=300, answer="", scoring="contains",
                               input_ids=torch.randint(20, 200, (n,), generator=gen).tolist())
               for n in (300, 300, 260)]  # one nominal length, two token counts
    state = hf.apply(loaded.model, low_run["artifact_dir"], options={"sale": {"stats": True}})
    try:
        eager = answer_prompts(loaded, prompts, 5, state, batch_tokens=1000, loop="eager")
        static = answer_prompts(loaded, prompts, 5, state, batch_tokens=1000, loop="static")
        ragged = answer_prompts(loaded, prompts, 5, state, batch_tokens=1000, loop="static-ragged")
    finally:
        hf.remove(loaded.model)
    assert [r.prediction for r in static] == [r.prediction for r in eager] == [r.prediction for r in ragged]
    assert all(r.prediction for r in eager)  # five tokens each (no stop token in a contains reply here)
    for a, b in zip(static, eager):
        assert a.stats["sparsity"] == pytest.approx(b.stats["sparsity"]) and 0 < a.stats["sparsity"] < 1
    # one ragged batch of all three: its stats are the mean over the three prompts' prefill calls
    assert len({r.stats["sparsity"] for r in ragged}) == 1
    lo, hi = sorted({r.stats["sparsity"] for r in eager})
    assert lo < ragged[0].stats["sparsity"] < hi


def test_eval_loop_is_static_on_cuda():
    """SAAP and SANTA count their stats inside the graphs, so ``auto`` is the static loop on CUDA for
    every method."""
    from omegaconf import OmegaConf

    from calib.errors import UserError
    from calib.evaluate import eval_loop

    auto = OmegaConf.create({"eval": {"loop": "auto"}})
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [eval_loop(auto, cuda, m) for m in ("dense", "sale", "sampleattention", "saap", "santa")] == [
        "static-ragged"] * 5
    assert eval_loop(auto, cpu, "sale") == "eager" and eval_loop(auto, cpu, "saap") == "eager"
    assert eval_loop(OmegaConf.create({"eval": {"loop": "auto"}}), cuda, "saap") == "static-ragged"
    assert eval_loop(OmegaConf.create({"eval": {"loop": "static"}}), cpu, "saap") == "static-ragged"
    assert eval_loop(OmegaConf.create({"eval": {"loop": "static"}}), cpu, "sale") == "static-ragged"
    with pytest.raises(UserError, match="eval.loop must be auto, eager or static"):
        eval_loop(OmegaConf.create({"eval": {"loop": "fast"}}), cpu, "sale")


def test_an_empty_theta_curve_means_no_curve():
    """`method.theta_curve=[]` turns the extra sparsity report off (null does too); `calib_tasks=[]` stays an error."""
    from calib.config import compose
    from calib.sale.recipe import Settings

    assert Settings.from_cfg(compose(["+method=sale", "method.theta_curve=[]"])).theta_curve == []
    assert Settings.from_cfg(compose(["+method=sale", "method.theta_curve=null"])).theta_curve == []
