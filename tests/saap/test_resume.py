"""Per-layer checkpoints: atomic files keyed by config + data, and a SAAP run killed mid-stage that resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from calib.checkpoint import StageCheckpoints, stage_checkpoints
from calib.paths import project_root
from runtime_kernels.artifact import load_artifact
from tests.recipe_support import run_recipe
from tests.subprocess_env import python_path

LAYERS = [1, 2, 3]  # tiny's 4 layers without the dense layer 0
OVERRIDES = [
    "+method=saap", "model=tiny", "model.init=random", "device=cpu", "model.lengths=[256,384]",
    "data.tasks=[niah_single,kv_retrieval]", "method.clusters=8", "method.window=32", "method.long_range=64",
    "method.top_l=8", "method.top_l_layers=null", "method.iterations=5", "method.prompts=3", "method.top_ls=[2,8]",
    "method.classifier.hidden=32", "method.classifier.steps=400", "method.classifier.batch=64",
    "method.classifier.queries_per_prompt=48", "method.classifier.query_candidates=null", "method.eval.prompts=2",
    "method.eval.queries_per_prompt=8",
]


def test_checkpoint_key_separates_configs_and_data(calib_home):
    a = stage_checkpoints("saap", {"method": {"clusters": 8}, "tracking": {"uri": "x"}}, data_hash="d1")
    same = stage_checkpoints("saap", {"method": {"clusters": 8}, "tracking": {"uri": "y"}}, data_hash="d1")
    other_cfg = stage_checkpoints("saap", {"method": {"clusters": 16}}, data_hash="d1")
    other_data = stage_checkpoints("saap", {"method": {"clusters": 8}}, data_hash="d2")
    assert a.directory == same.directory  # where results are logged does not change them
    assert len({a.directory, other_cfg.directory, other_data.directory}) == 3
    assert a.directory.parent == calib_home / "artifacts" / "scratch" / "checkpoints"


def test_layer_computes_once_then_loads(tmp_path):
    ckpt = StageCheckpoints(tmp_path / "c")
    calls = []

    def compute() -> dict[str, torch.Tensor]:
        calls.append(1)
        return {"w": torch.arange(6.0).reshape(2, 3), "flag": torch.tensor([True, False])}

    first = ckpt.layer("kmeans", 2, compute)
    reopened = StageCheckpoints(tmp_path / "c")
    again = reopened.layer("kmeans", 2, compute)
    assert len(calls) == 1 and torch.equal(first["w"], again["w"]) and again["flag"].tolist() == [True, False]
    assert sorted(again) == ["flag", "w"]  # the recorded compute time is not handed back as a tensor
    assert reopened.loaded == 1 and reopened.seconds["kmeans"] == pytest.approx(ckpt.seconds["kmeans"])
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["kmeans.layer_2.safetensors"]  # no temp file left


def test_compute_seconds_survive_a_restart(tmp_path):
    """What a stage cost is the sum of its layers' compute times, whichever run computed them."""
    first = StageCheckpoints(tmp_path / "c")
    first.layer("kmeans", 0, lambda: (time.sleep(0.2), {"w": torch.ones(2)})[1])
    first.save("kmeans", 1, {"w": torch.zeros(2)}, seconds=1.5)
    assert first.seconds["kmeans"] == pytest.approx(1.7, abs=0.1)
    restarted = StageCheckpoints(tmp_path / "c")
    for layer in (0, 1):
        restarted.layer("kmeans", layer, lambda: pytest.fail("a finished layer was recomputed"))
    restarted.layer("kmeans", 2, lambda: {"w": torch.ones(2)})
    assert restarted.loaded == 2 and restarted.computed == 1
    assert restarted.seconds["kmeans"] == pytest.approx(first.seconds["kmeans"], abs=0.05)


def test_training_rows_round_trip():
    from calib.saap.recipe import TrainingRows
    from calib.saap.resume import rows_from_tensors, rows_to_tensors

    g = torch.Generator().manual_seed(0)
    rows = TrainingRows(x=[torch.randn(4, 3, 16, generator=g), torch.randn(4, 5, 16, generator=g)],
                        targets=[torch.rand(4, 3, 8, generator=g), torch.rand(4, 5, 8, generator=g)],
                        long_range=[torch.rand(4, 3, generator=g) > 0.5, torch.rand(4, 5, generator=g) > 0.5],
                        prompt=[0, 2], answer=[torch.zeros(4, 3, dtype=torch.bool), torch.ones(4, 5, dtype=torch.bool)],
                        positions=[torch.arange(12).reshape(4, 3), torch.arange(20).reshape(4, 5)])
    back = rows_from_tensors(rows_to_tensors(rows), TrainingRows)
    assert back.prompt == [0, 2]
    for name in ("x", "targets", "long_range", "answer", "positions"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(rows, name), getattr(back, name), strict=True)), name


def _artifact_tensors(result: dict) -> dict[str, torch.Tensor]:
    art = load_artifact(result["artifact_dir"], method="saap")
    return {t.name: art.tensor(t.name) for t in art.manifest.tensors}


# ``calib run`` that stops itself (SIGSTOP) right after saving its first classifier layer: the test then kills it
# at a known point, however loaded the machine is (polling for the file raced the remaining, fast layers)
STOP_AFTER_FIRST_CLASSIFIER = """
import os, runpy, signal, sys
from calib.checkpoint import StageCheckpoints
save = StageCheckpoints.save
def save_then_stop(self, stage, layer, *args, **kwargs):
    out = save(self, stage, layer, *args, **kwargs)
    if stage == "classifier":
        os.kill(os.getpid(), signal.SIGSTOP)
    return out
StageCheckpoints.save = save_then_stop
sys.argv = ["calib", *sys.argv[1:]]
runpy.run_module("calib", run_name="__main__", alter_sys=True)
"""


def _wait_until_stopped(proc: subprocess.Popen, timeout_s: float) -> None:
    """Block until ``proc`` stops itself; fail with its stderr if it exits first or takes ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return
        assert not pid, f"the run ended before a classifier layer was saved: {proc.stderr.read()[-2000:]}"
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"no classifier checkpoint within {timeout_s:.0f} s")


@pytest.mark.slow
def test_killed_run_resumes_from_finished_layers(tmp_path):
    """Kill ``calib run`` right after its first classifier layer is saved; the rerun loads 3 + 3 + 1 layers and
    computes 2, and its artifact equals an uninterrupted run's."""
    home = tmp_path / "home"
    (home / "artifacts").mkdir(parents=True)
    # the killed run trains with this process's thread count: float32 sums split over other thread counts
    # differ in the last bits, and 400 optimizer steps carry that past the comparison's tolerance
    env = {**os.environ, "CALIB_HOME": str(home), "PYTHONPATH": python_path(project_root()),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-c", STOP_AFTER_FIRST_CLASSIFIER, "run", *OVERRIDES], env=env,
                            cwd=project_root(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _wait_until_stopped(proc, 400)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    scratch = home / "artifacts" / "scratch" / "checkpoints"
    (ckpt_dir,) = scratch.glob("saap-*")
    finished = sorted(p.name for p in ckpt_dir.glob("*.safetensors"))
    done_classifiers = [n for n in finished if n.startswith("classifier.")]
    assert [n for n in finished if n.startswith("kmeans.")] == [f"kmeans.layer_{l}.safetensors" for l in LAYERS]
    assert len([n for n in finished if n.startswith("targets.")]) == len(LAYERS)
    assert len(done_classifiers) == 1  # killed where it stopped: after the first classifier layer

    resumed = run_recipe(home, OVERRIDES)
    assert resumed["metrics"]["checkpoint_layers_loaded"] == 2 * len(LAYERS) + len(done_classifiers)
    m = resumed["metrics"]
    # k-means all came from the killed run: this run's own stage time is only the loading, the cost is kept
    assert m["compute_kmeans_s"] > m["time_kmeans_s"] and m["compute_classifier_s"] > 0
    assert not ckpt_dir.exists()  # removed once every stage finished

    reference = run_recipe(tmp_path / "reference", OVERRIDES)
    assert reference["metrics"]["checkpoint_layers_loaded"] == 0
    got, want = _artifact_tensors(resumed), _artifact_tensors(reference)
    assert sorted(got) == sorted(want) and len(want) == 9 * len(LAYERS)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
