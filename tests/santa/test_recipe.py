"""`calib run +method=santa` end to end, the worker/aggregator commands, the reward evaluator, validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from santa_checks import check_rl_dir

from calib.errors import UserError
from tests.recipe_support import in_calib_home, run_recipe
from tests.subprocess_env import python_path

ARCH = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "hidden_size": 64,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama (GQA 4/2, head_dim 16) with the tiny tokenizer: synthetic prompts work."""
    from calib.data.tokenizer import build_tiny_backend, save_tiny_tokenizer
    from calib.models import random_model

    out = tmp_path_factory.mktemp("santa_llama")
    random_model("llama", {**ARCH, "vocab_size": build_tiny_backend().get_vocab_size()}, seed=0).save_pretrained(out)
    save_tiny_tokenizer(out)
    return out


def overrides(model_dir: Path, *extra: str) -> list[str]:
    arch = [f"model.arch.{k}={'null' if v is None else v}" for k, v in ARCH.items()]
    return ["+method=santa", f"model.path={model_dir}", "model.name=rand-santa", *arch, "model.lengths=[192]",
            "device=cpu", "data.tasks=[kv_retrieval,niah_single]", "method.reward.length=192",
            "method.reward.pool=4", "rl.questions_per_episode=2", "rl.episodes=2", "rl.heldout_questions=6",
            "rl.poll_s=0.2", "rl.threads=1", "eval.bootstrap=200", "eval.max_new_tokens=4",
            "method.deploy.questions=4", "method.deploy.budgets_per_layer=[1,4]", *extra]


def _compose(model_dir: Path, *extra: str) -> Any:
    from calib.config import compose

    return compose(overrides(model_dir, *extra))


def _largest_remainder(theta: np.ndarray, n: int) -> np.ndarray:
    """round(N softmax(theta)), >= 1 per layer, summing to N (written out independently, small L)."""
    p = np.exp(theta - theta.max())
    p /= p.sum()
    quota = n * p
    s = np.maximum(np.floor(quota), 1).astype(int)
    order = np.argsort(-(quota - s), kind="stable")
    i = 0
    while s.sum() < n:
        s[order[i % len(s)]] += 1
        i += 1
    return s


# ------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def run_result(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("home")
    result = run_recipe(home, overrides(model_dir, "rl.workers=1", "rl.iterations=2"))
    return {**result, "home": home}


def test_run_metrics_report_learned_and_uniform_rewards(run_result):
    m = run_result["metrics"]
    assert run_result["model_uri"] == "models:/santa-rand-santa/1"
    for key, low in (("reward_learned", 0.0), ("reward_uniform", 0.0), ("reward_learned_minus_uniform", -1.0)):
        assert low <= m[f"{key}_ci_low"] <= m[key] <= m[f"{key}_ci_high"] <= 1.0
    assert any("learned" in k for k in m) and any("uniform" in k for k in m)
    assert m["heldout_questions"] == 6 and m["iterations"] == 2 and m["budget"] == 16
    assert m["num_results"] >= 4  # two iterations, each at least one batch of 2 episodes


def test_run_artifact_schedule_and_rl_dir(run_result):
    from runtime_kernels.artifact import load_artifact

    art = load_artifact(run_result["artifact_dir"], method="santa")
    schedule, theta, probs = art.tensor("schedule"), art.tensor("theta"), art.tensor("probs")
    assert schedule.dtype == torch.int64 and theta.dtype == probs.dtype == torch.float32
    assert schedule.shape == theta.shape == probs.shape == (2,)
    man = art.manifest
    default = man.payload["default_budget"]
    assert default in (2, 8, 16) and man.hyperparameters["default_budget"] == default  # the ladder: 1, 4, 8 per layer
    assert int(schedule.sum()) == default and int(schedule.min()) >= 1
    assert man.payload["schedule"] == schedule.tolist() and man.payload["training_budget"] == 16
    assert man.hyperparameters["N"] == 16 and man.hyperparameters["phases"] == ["prefill", "decode"]
    assert (man.payload["tiling"], man.payload["tile"], man.payload["estimator"]) == ("flash", 256, "sys")
    rl_dir = Path(man.payload["rl_dir"])
    for sub in ("policy", "history", "claimed"):
        assert (rl_dir / sub).is_dir()
    facts = check_rl_dir(rl_dir, num_layers=2, budget=16)  # consecutive snapshots, REINFORCE math, no double count
    assert facts.iterations == 2 and (rl_dir / "done.json").exists()
    np.testing.assert_allclose(theta.double().numpy(), facts.thetas[-1], rtol=0, atol=1e-6)
    assert man.payload["training_schedule"] == _largest_remainder(facts.thetas[-1], 16).tolist()
    assert schedule.tolist() == _largest_remainder(np.log(probs.double().numpy()), default).tolist()
    assert man.data.seed == 1234 and man.data.count == 4 and man.data.lengths == [192]


def test_run_logs_iterations_and_plots(run_result):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_result['home'] / 'artifacts' / 'mlflow.db'}")
    run = client.get_run(run_result["run_id"])
    steps = [x.step for x in client.get_metric_history(run.info.run_id, "rl/reward_mean")]
    assert sorted(set(steps)) == [1, 2]
    assert {"rl/p_layer_0", "rl/p_layer_1", "rl/grad_norm", "rl/policy_entropy", "time_reinforce_s"} <= set(run.data.metrics)
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert {"plots/santa_reward_curve.png", "plots/santa_policy_heatmap.png", "plots/santa_schedule.png",
            "plots/santa_accuracy_vs_budget.png"} <= plots
    curve = client.get_metric_history(run.info.run_id, "deploy/accuracy_learned")
    assert sorted(x.step for x in curve) == [2, 8, 16]
    assert {"time_deploy_s", "deploy_budget", "deploy_accuracy_dense", "deploy.uniform.N8"} <= set(run.data.metrics)


def test_artifact_applies_to_the_model(run_result, model_dir):
    from calib.models import load_model
    from runtime_kernels import hf
    from runtime_kernels.artifact import load_artifact
    from runtime_kernels.errors import ArtifactError
    from runtime_kernels.santa.runtime import SantaDecode
    from runtime_kernels.santa.schedule import apportion

    loaded = load_model(_compose(model_dir).model, device="cpu")
    try:
        state = hf.apply(loaded.model, run_result["artifact_dir"], options={"santa": {"stats": True}})
        assert isinstance(state.decode, SantaDecode) and state.prefill is state.decode
        want = load_artifact(run_result["artifact_dir"]).tensor("schedule").tolist()
        assert state.decode.schedule == want
        with torch.no_grad():
            out = loaded.model(input_ids=torch.arange(5, 69)[None], use_cache=True)
        assert torch.isfinite(out.logits).all() and state.decode.pop_stats()["sampled_calls"] == 2
        probs = load_artifact(run_result["artifact_dir"]).tensor("probs").double().tolist()
        state = hf.apply(loaded.model, run_result["artifact_dir"], options={"santa": {"budget": 7, "stats": True}})
        assert state.decode.schedule == apportion(probs, 7) and sum(state.decode.schedule) == 7
        with pytest.raises(ArtifactError, match="integer >= 2"):
            hf.apply(loaded.model, run_result["artifact_dir"], options={"santa": {"budget": 1}})
    finally:
        hf.remove(loaded.model)


def test_eval_reports_dense_vs_santa_accuracy(run_result, model_dir):
    """`calib eval artifact=<dir>`: dense and SANTA accuracy per task@length plus SANTA's sample stats."""
    from calib.evaluate import evaluate

    cfg = _compose(model_dir, f"artifact={run_result['artifact_dir']}", "eval.num_prompts=1",
                   "eval.tasks=[kv_retrieval]", "eval.max_new_tokens=2")
    result = in_calib_home(run_result["home"], evaluate, cfg)
    assert result["tasks"].keys() == {"kv_retrieval@192"}
    assert set(result["tasks"]["kv_retrieval@192"]) == {"dense", "sparse"}
    m = result["metrics"]
    from runtime_kernels.artifact import load_artifact

    schedule = load_artifact(run_result["artifact_dir"]).tensor("schedule").tolist()  # the default budget's
    assert m["kv_retrieval@192.mean_samples"] == pytest.approx(np.mean(schedule))  # every layer, prefill and decode
    assert 0 < m["kv_retrieval@192.sample_fraction"] < 1
    # eval.budget: the learned share scaled to N = 7 over the 2 layers
    at_seven = in_calib_home(run_result["home"], evaluate, _compose(
        model_dir, f"artifact={run_result['artifact_dir']}", "eval.num_prompts=1", "eval.tasks=[kv_retrieval]",
        "eval.max_new_tokens=2", "eval.budget=7"))
    assert at_seven["metrics"]["kv_retrieval@192.mean_samples"] == pytest.approx(7 / 2)


# ------------------------------------------------------------------------------ commands


def test_worker_and_aggregator_commands(model_dir, tmp_path, calib_home):
    from calib.santa.commands import RUN_FILE, aggregator, worker

    rl_dir = tmp_path / "rl"
    cfg = _compose(model_dir, f"rl.dir={rl_dir}", "rl.iterations=1", "rl.max_batches=1", "rl.episodes=1", "rl.seed=5")
    box: dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(worker(cfg)), daemon=True)
    t.start()
    out = aggregator(cfg)  # main thread: installs its SIGTERM handler
    t.join(60)
    assert box["batches"] == 1 and box["stopped_because"] in ("max_batches", "done")
    assert out["iteration"] == 1 and out["committed"] == [1] and sum(out["schedule"]) == 16
    check_rl_dir(rl_dir, num_layers=2, budget=16)
    recorded = json.loads((rl_dir / RUN_FILE).read_text())
    assert recorded["run_id"] == out["run_id"]
    again = aggregator(cfg)  # restarted: nothing to do, logs into the same MLflow run (replayed callback)
    assert again["run_id"] == out["run_id"] and again["committed"] == []


def _cli(*args: str, env_home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CALIB_HOME": str(env_home), "PYTHONPATH": python_path(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "calib", *args], capture_output=True, text=True, timeout=120,
                          cwd=env_home, env=env)


def test_cli_commands(model_dir, tmp_path, calib_home):
    res = _cli("worker", *overrides(model_dir)[1:], env_home=calib_home)
    assert res.returncode == 2 and "rl.dir=" in res.stderr and "Traceback" not in res.stderr
    rl_dir = tmp_path / "cli-rl"
    res = _cli("aggregator", *overrides(model_dir)[1:], f"rl.dir={rl_dir}", "rl.iterations=0", env_home=calib_home)
    assert res.returncode == 0, res.stderr[-2000:]
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["iteration"] == 0 and last["schedule"] == [8, 8] and (rl_dir / "policy" / "policy-0.json").exists()


# ----------------------------------------------------------------------------------- reward


def test_evaluator_draws_distinct_questions_and_runs_the_schedule(model_dir, monkeypatch):
    import calib.santa.reward as reward
    from calib.models import load_model

    cfg = _compose(model_dir, "rl.questions_per_episode=3")
    loaded = load_model(cfg.model, device="cpu")
    pool = reward.reward_prompts(cfg, loaded.tokenizer, heldout=False, count=4)
    held = reward.reward_prompts(cfg, loaded.tokenizer, heldout=True, count=4)
    assert [p.task for p in pool] == ["kv_retrieval", "niah_single"] * 2
    assert not {p.text for p in pool} & {p.text for p in held}
    calls: list[tuple] = []

    def fake(loaded_, prompts, max_new, runtime, seeds=None, desc="", batch_tokens=0, loop="eager"):
        assert loop == "eager"  # method.reward.loop=auto on the CPU
        calls.append(([p.prompt_id for p in prompts], list(max_new), runtime, list(seeds)))
        return np.array([True, False, True])

    monkeypatch.setattr(reward, "answer_correct", fake)
    evaluate = reward.make_evaluator(cfg, loaded, pool)
    r1 = evaluate([1, 7], np.random.default_rng(3))
    r2 = evaluate([1, 7], np.random.default_rng(3))
    assert r1 == r2 == pytest.approx(2 / 3)
    ids, max_new, rt, seeds = calls[0]
    assert len(set(ids)) == 3 and set(ids) <= {p.prompt_id for p in pool} and ids == calls[1][0]
    assert rt.schedule == [1, 7] and rt.phase == "both" and len(set(seeds)) == 3 and seeds == calls[1][3]
    answers = {p.prompt_id: p.answer for p in pool}
    tok = loaded.tokenizer
    assert max_new == [min(4, len(tok(" " + answers[i], add_special_tokens=False)["input_ids"]) + 2) for i in ids]
    with pytest.raises(ValueError, match="layers"):
        evaluate([1, 2, 3], np.random.default_rng(0))


def test_deploy_questions_are_calibration_side_and_outside_the_reward_pool(model_dir):
    """skip=pool: the next prompts of each task from the calibration seed, none of the pool's, not eval.seed's."""
    from calib.models import load_model
    from calib.santa.reward import reward_prompts

    cfg = _compose(model_dir)
    tok = load_model(cfg.model, device="cpu").tokenizer
    pool = reward_prompts(cfg, tok, heldout=False, count=4)
    extra = reward_prompts(cfg, tok, heldout=False, count=4, skip=4, setting="method.deploy.questions")
    tasks = ("kv_retrieval", "niah_single")
    assert [p.prompt_id for p in pool] == [f"{t}-192-s1234-{i}" for i in (0, 1) for t in tasks]
    assert [p.prompt_id for p in extra] == [f"{t}-192-s1234-{i}" for i in (2, 3) for t in tasks]


def test_heldout_scores_do_not_depend_on_sharding(model_dir, monkeypatch):
    """Sharded over 2 child processes == in process: per-question seeds, questions j::shards merged back."""
    import dataclasses

    import calib.santa.heldout as heldout
    from calib.evaluate import greedy_generate, stop_token_ids
    from calib.models import load_model
    from calib.santa.reward import question_seeds, reward_prompts

    cfg = _compose(model_dir, "method.reward.length=64", "rl.workers=2")
    loaded = load_model(cfg.model, device="cpu")
    stops = stop_token_ids(loaded.tokenizer)
    prompts = []  # answers = the dense model's own greedy output, so dense scores 1 and sampling can miss
    for p in reward_prompts(cfg, loaded.tokenizer, heldout=True, count=8):
        text = loaded.tokenizer.decode(greedy_generate(loaded.model, p.input_ids, 2, stops), skip_special_tokens=True)
        prompts.append(dataclasses.replace(p, answer=text))
    schedules = {"one": [1, 1], "dense": None}
    seeds, max_new = question_seeds(0, 8), [2] * 8
    local = heldout.score_schedules(cfg, loaded, prompts, max_new, seeds, schedules, shards=1)
    monkeypatch.setattr(heldout, "MIN_PER_SHARD", 2)
    sharded = heldout.score_schedules(cfg, loaded, prompts, max_new, seeds, schedules, shards=2)
    assert local["dense"].all() and not local["one"].all()
    assert np.array_equal(local["one"], sharded["one"]) and np.array_equal(local["dense"], sharded["dense"])


def test_uniform_sweep_command(model_dir, capsys):
    from calib.santa.sweep import main

    args = overrides(model_dir, "rl.heldout_questions=4")[1:]
    assert main(["sweep=1,2", *args]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["uniform_reward"]
    assert set(got) == {"1", "2", "dense"} and all(v["n"] == 4 and 0 <= v["reward"] <= 1 for v in got.values())
    assert main(["sweep=1", *args, "rl.workers=0"]) == 2


def test_uniform_sweep_totals_score_every_placement(model_dir, capsys, monkeypatch):
    """sweep_total=3 on 2 layers: N3 is theta=0's [2, 1]; both placements scored; N3:mean is their mean."""
    import calib.santa.heldout as heldout
    from calib.santa.sweep import main

    scored: list[dict] = []
    real = heldout._score_unique

    def spy(cfg, loaded, work, shards, progress):
        scored.extend(dict(unique) for _, unique in work)
        return real(cfg, loaded, work, shards, progress)

    monkeypatch.setattr(heldout, "_score_unique", spy)
    args = overrides(model_dir, "rl.heldout_questions=6", "method.reward.heldout_dense=false")[1:]
    assert main(["sweep=1", "sweep_total=3", *args]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["uniform_reward"]
    assert set(got) == {"1", "N3", "N3:2-1", "N3:1-2", "N3:mean"}
    assert got["N3"]["schedule"] == got["N3:2-1"]["schedule"] == [2, 1] and got["N3:1-2"]["schedule"] == [1, 2]
    assert got["N3"]["reward"] == got["N3:2-1"]["reward"]
    assert got["N3:mean"]["reward"] == pytest.approx((got["N3:2-1"]["reward"] + got["N3:1-2"]["reward"]) / 2)
    assert sorted(map(tuple, scored[0].values())) == [(1, 1), (1, 2), (2, 1)]  # [2, 1] scored once
    assert main(["sweep_total=1", *args]) == 2  # below one sample per layer


def test_placement_summary_hand_worked():
    from calib.santa.heldout import placement_summary

    got = {"a": np.array([1, 0, 0, 1]), "b": np.array([1, 1, 1, 0]), "c": np.array([0, 0, 0, 0])}
    places = {"a": [2, 1, 1], "b": [1, 2, 1], "c": [1, 1, 2]}
    out = placement_summary(got, places, resamples=200, seed=0)
    assert out["reward_uniform_mean"] == pytest.approx((2 + 3 + 0) / 12)
    assert out["reward_uniform_best"] == pytest.approx(0.75) and out["uniform_placements"] == 3
    assert [out[f"uniform_best_schedule.layer_{i}"] for i in range(3)] == [1, 2, 1]
    assert out["reward_uniform_best_ci_low"] <= 0.75 <= out["reward_uniform_best_ci_high"]


# ------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("extra, match", [
    (["rl.workers=0"], "rl.workers"),
    (["rl.budget_per_layer=0"], "one sample per layer"),
    (["rl.budget=1"], "one sample per layer"),
    (["method.estimator=iid"], "estimator=sys"),
    (["method.reward.phases=[prefill]"], "phases"),
    (["method.reward.pool=1"], "pool"),
    (["rl.lr=-1"], "rl.lr"),
    (["rl.iterations=1.5"], "integer"),
    (["rl.heldout_questions=0"], "heldout_questions"),
    (["rl.lease_wait_s=-1"], "rl.lease_wait_s must be >= 0 or null"),
    (["rl.heldout_uniform_placements=2"], "rl.heldout_uniform_placements must be true or false"),
    (["method.reward.heldout_dense=null"], "method.reward.heldout_dense must be true or false"),
    (["method.reward.length=8"], "method.reward.length must be >= 16 or null"),
    (["method.deploy.tolerance=1"], r"method.deploy.tolerance must be in \[0, 1\)"),
    (["method.deploy.budgets_per_layer=[8,0]"], "method.deploy.budgets_per_layer must list integers >= 1"),
], ids=["workers", "budget", "total-budget", "estimator", "phases", "pool", "lr", "iterations", "heldout",
        "lease-wait", "placements", "heldout-dense", "reward-length", "tolerance", "ladder"])
def test_validate_errors(model_dir, extra, match):
    from calib.santa.recipe import validate

    with pytest.raises(UserError, match=match) as info:
        validate(_compose(model_dir, *extra))
    assert "\n" not in str(info.value)


def test_validate_accepts_defaults(model_dir):
    from calib.config import compose
    from calib.santa.recipe import validate

    validate(compose(["+method=santa"]))
    validate(_compose(model_dir, "method.tiling=none", "method.estimator=iid", "rl.budget=5"))


def test_reinforce_step_and_length_follow_the_model():
    """The paper's step (0.02) and the 12-update CPU default unless a model sets its own: SmolLM2's
    0.25 x 240 is the recipe that separated learned from uniform there (docs/results/smollm2.md)."""
    from calib.config import compose

    rl = {m: compose(["+method=santa", f"model={m}"]).rl for m in ("tiny", "smollm2")}
    assert (rl["tiny"].lr, rl["tiny"].iterations) == (0.02, 12)
    assert (rl["smollm2"].lr, rl["smollm2"].iterations) == (0.25, 240)
    assert compose(["+method=santa", "model=smollm2", "rl.lr=0.5"]).rl.lr == 0.5


def test_heldout_comparison_scores_every_uniform_placement(model_dir, monkeypatch):
    """N = 3 on 2 layers: uniform = theta=0's [2, 1]; the other placement [1, 2] is scored too, and the
    best-placement metrics say whether learned beats even the luckiest uniform."""
    import calib.santa.heldout as heldout

    correct = {(2, 1): [1, 0, 0, 0, 1, 0], (1, 2): [1, 1, 1, 0, 1, 0], (1, 1): [0] * 6}
    seen: list[dict] = []

    def fake(cfg, loaded, prompts, max_new, seeds, schedules, shards, desc="score"):
        seen.append(dict(schedules))
        learned = [1, 1, 1, 1, 1, 1]
        return {name: np.array(learned if name == "learned" else correct[tuple(s)], dtype=bool)
                for name, s in schedules.items()}

    from calib.models import load_model

    monkeypatch.setattr(heldout, "score_schedules", fake)
    cfg = _compose(model_dir, "method.reward.heldout_dense=false")
    loaded = load_model(cfg.model, device="cpu")
    out = heldout.heldout_comparison(cfg, loaded, np.array([1, 2]), np.array([2, 1]), 6, shards=1)
    assert set(seen[0]) == {"learned", "uniform", "uniform_placement:2-1", "uniform_placement:1-2"}
    assert out["reward_uniform"] == pytest.approx(2 / 6) and out["reward_uniform_mean"] == pytest.approx(6 / 12)
    assert out["reward_uniform_best"] == pytest.approx(4 / 6) and out["uniform_placements"] == 2
    assert (out["uniform_best_schedule.layer_0"], out["uniform_best_schedule.layer_1"]) == (1, 2)
    assert out["heldout_ci_separated_best"] == float(out["reward_learned_ci_low"] > out["reward_uniform_best_ci_high"])
    cfg = _compose(model_dir, "method.reward.heldout_dense=false", "rl.heldout_uniform_placements=false")
    out = heldout.heldout_comparison(cfg, loaded, np.array([1, 2]), np.array([2, 1]), 6, shards=1)
    assert set(seen[1]) == {"learned", "uniform"} and "reward_uniform_best" not in out


def test_eval_budget_is_a_santa_option():
    from omegaconf import OmegaConf

    from calib.evaluate import runtime_options

    cfg = OmegaConf.create({"eval": {"budget": 480}})
    assert runtime_options(cfg, "santa") == {"santa": {"budget": 480}}
    assert runtime_options(OmegaConf.create({"eval": {"budget": None}}), "santa") == {}
    with pytest.raises(UserError, match="eval.budget is a SANTA setting"):
        runtime_options(cfg, "saap")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(UserError, match="eval.budget must be a positive integer"):
            runtime_options(OmegaConf.create({"eval": {"budget": bad}}), "santa")


def test_deploy_ladder_questions_have_the_deploy_length(model_dir, monkeypatch):
    """method.deploy.length: the ladder scores synthetic questions of that many tokens (the longest context
    the artifact serves), not the reward's; the default budget comes from those scores."""
    import calib.santa.deploy as deploy
    from calib.models import load_model
    from calib.santa.deploy import run_ladder

    cfg = _compose(model_dir, "method.deploy.length=256", "method.deploy.questions=4",
                   "method.deploy.budgets_per_layer=[1,2,4]")
    loaded = load_model(cfg.model, device="cpu")
    seen = []

    def fake(cfg_, loaded_, groups, shards, desc=""):
        seen.extend(groups)
        q = len(groups[0].prompts)
        # learned: wrong at N=2, right from N=4 on; dense right on every question
        return [{name: np.full(q, name == "dense" or (name.startswith("learned") and int(name.split(":")[1]) >= 4))
                 for name in groups[0].schedules}]

    monkeypatch.setattr(deploy, "score_groups", fake)
    result = run_ladder(cfg, loaded, np.array([0.5, 0.5]), training_budget=2, shards=1)
    assert {p.length for p in seen[0].prompts} == {256} and len(seen[0].prompts) == 4
    assert all(abs(len(p.input_ids) - 256) <= 16 for p in seen[0].prompts)
    assert result.budgets == [2, 4, 8] and result.default_budget == 4 and result.within_tolerance
    with pytest.raises(UserError, match="method.deploy.length must be >= 1 or null"):
        run_ladder(_compose(model_dir, "method.deploy.length=0"), loaded, np.array([0.5, 0.5]), 2, 1)
