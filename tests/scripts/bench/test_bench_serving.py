"""scripts/bench/bench_serving.py: its table and accuracy column from hand-made rows, and one CPU smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

import bench_serving as bench  # noqa: E402


def test_accuracy_column_reads_a_calib_eval_result(tmp_path):
    result = {"metrics": {"diff": -0.01, "diff_ci_low": -0.03, "diff_ci_high": 0.005, "suite.books.diff": -0.05,
                          "suite.books.diff_ci_low": -0.1, "suite.books.diff_ci_high": 0.0, "selectivity": 0.3}}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(result))
    assert bench.accuracy_line(str(path)) == ("all -0.010 (-0.030, +0.005); books -0.050 (-0.100, +0.000); "
                                               "selectivity 0.30")


def test_a_prompts_file_that_cannot_be_read_is_a_one_line_error_before_any_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts", str(tmp_path / "missing.jsonl")])
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": 1}\n')
    with pytest.raises(SystemExit):
        bench.parse_args(["--prompts", str(bad)])
    assert 'bad.jsonl:1: needs a non-empty string field "prompt"' in capsys.readouterr().err


def test_continued_as_dense_counts_the_file_prompts_whose_tokens_the_method_leaves_unchanged():
    """Three prompts in batches of two (the last filled with the first prompt again): the method changes the
    second prompt's tokens only, so two of three continue as dense does; the filler row is not counted."""
    state = SimpleNamespace(prefill="sale", decode=None)
    model = SimpleNamespace(calib_attention=state)

    class Gen:
        def generate(self, rows, steps):
            changed = lambda r: state.prefill is not None and r[0] == 2  # noqa: E731
            return torch.tensor([[9 if changed(r) else r[0]] * steps for r in rows])

    groups = [[[1], [2]], [[3], [1]]]
    assert bench.continued_as_dense(model, Gen(), groups, steps=2, count=3) == 2
    assert state.prefill == "sale"  # switched back on after dense's run
    assert bench.continued_as_dense(model, Gen(), [[[1], [3]]], steps=2, count=2) == 2


def test_table_ratios_are_to_dense_at_the_same_point_and_loop(capsys):
    rows = [bench.Row("dense", "decode", 8000, 64, False, ms=8.0, kv_floor_ms=4.0),
            bench.Row("saap", "decode", 8000, 64, False, ms=6.4, dense_layers=5),
            bench.Row("no-attention", "decode", 8000, 64, False, ms=3.2),
            bench.Row("dense", "decode", 8000, 64, True, ms=6.0),
            bench.Row("saap", "decode", 8000, 64, True, ms=5.0)]
    bench.print_tables(rows, {"saap": "books -0.01"})
    lines = {tuple(c.strip() for c in line.split("|")[3:7]): line for line in capsys.readouterr().out.splitlines()[2:]}
    saap = lines[("64", "saap", "no", "6.40")]
    assert "| 1.25 |" in saap and "| 3.20 |" in saap and "books -0.01" in saap  # 8.0 / 6.4; no-attention beside it
    assert "| 1.20 |" in lines[("64", "saap", "yes", "5.00")]  # compiled against compiled dense: 6.0 / 5.0


def test_a_ttft_ratio_is_to_the_dense_prefill_timed_in_the_same_process(capsys):
    rows = [bench.Row("dense", "ttft", 8000, 1, False, ms=40.0),  # another process: not the reference
            bench.Row("sale", "ttft", 8000, 1, False, ms=30.0, dense_ms=27.0),
            bench.Row("no-attention", "ttft", 8000, 1, False, ms=12.5, dense_ms=26.0),
            bench.Row("no-attention", "decode", 8000, 1, False, ms=2.5)]
    bench.print_tables(rows, {})
    sale = next(line for line in capsys.readouterr().out.splitlines() if "| sale |" in line)
    assert "| 0.90 |" in sale  # 27.0 / 30.0, not 40.0 / 30.0
    assert "| 12.50 |" in sale and "| 2.50 |" not in sale  # the prefill floor beside a TTFT, not the step's


def test_a_paired_row_reads_the_median_of_its_pairs_with_the_interval_beside_it(capsys):
    """A row that carries its pairs' median ratio and interval prints those, not the ratio of its medians
    (27.0 / 30.0 = 0.90); rows saved before the pairs' figures existed print the ratio of medians and '-'."""
    rows = [bench.Row("sale", "ragged", 8000, 16, False, ms=30.0, dense_ms=27.0, ratio=1.01, ratio_ci=(0.99, 1.02)),
            bench.Row("sale", "ragged", 2048, 16, False, ms=30.0, dense_ms=27.0)]
    bench.print_tables(rows, {})
    out = capsys.readouterr().out
    assert "| 30.00 | 1.01 | 0.99-1.02 |" in next(line for line in out.splitlines() if "| 8000 |" in line)
    assert "| 30.00 | 0.90 | - |" in next(line for line in out.splitlines() if "| 2048 |" in line)


def test_no_attention_replaces_attention_in_prefill_and_decode():
    """The floor rows: a model with :class:`NoAttention` attached returns the query as every layer's
    attention output, in the prompt's forward pass and in a decode step."""
    from bench_generate import NoAttention

    floor = NoAttention()
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = floor.prefill(0, q, k, v, 0.3, None)
    assert torch.equal(out, q) and out.data_ptr() != q.data_ptr()
    assert torch.equal(floor.decode(0, q[:, :, -1:], k, v, 0.3, None), q[:, :, -1:])


@pytest.mark.slow
def test_smoke_run_on_the_cpu_prints_every_kind_of_row(tmp_path):
    script = ROOT / "scripts" / "bench" / "bench_serving.py"
    prompts = tmp_path / "traffic.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"text": "Say hello."}\n{"prompt": "Hi"}\n')
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--methods", "dense,no-attention",
                           "--prompts", str(prompts)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cells = [[c.strip() for c in line.split("|")[1:5]] for line in proc.stdout.splitlines()
             if line.startswith("| ") and "---" not in line]
    assert {"decode", "ttft", "second", "ragged", "traffic"} <= {c[0] for c in cells if c[3].split(" (")[0] == "dense"}
    # --smoke: 2 rows a batch; dense against itself continues every prompt the same
    assert "dense (3 prompts in 2 batches, 3 continued as dense does)" in {c[3] for c in cells if c[0] == "traffic"}
    assert {"decode", "ttft"} == {c[0] for c in cells if c[3] == "no-attention"}  # the step's and the prefill's floor


def test_a_ttft_row_counts_the_prefill_layers_that_did_not_run_the_method():
    """Four layers: the method declines layer 1 and runs the others (the chooser's path without a GPU);
    counts from earlier prefills are not carried over; no prefill method or another serve mode: None."""
    from runtime_kernels.serving_policy import PrefillChooser

    q = torch.zeros(1, 2, 8, 4)
    state = SimpleNamespace(prefill=object(), serve="fastest", prefill_chooser=PrefillChooser())
    model = SimpleNamespace(calib_attention=state, config=SimpleNamespace(num_hidden_layers=4))

    def prefill():
        for layer in range(4):
            state.prefill_chooser.run("sig", q, q, lambda layer=layer: None if layer == 1 else q, lambda: q)

    prefill()  # an earlier prefill's calls
    assert bench.prefill_dense_layers(model, prefill) == 1
    state.serve = "method"
    assert bench.prefill_dense_layers(model, prefill) is None
    assert bench.prefill_dense_layers(SimpleNamespace(calib_attention=None), prefill) is None


def test_a_ragged_row_says_where_its_prefill_layers_went():
    """Two layers; lengths 100, 101, 40 make two prefill calls (100 and 101 padded together) for a runtime
    that takes padded rows, three for one that does not. The stub's four layer calls: three ran the method,
    one went dense; the rest of the calls' layers never reached the chooser (the method switched off)."""
    from runtime_kernels.serving_policy import PrefillChooser

    q = torch.zeros(1, 2, 8, 4)
    runtime = SimpleNamespace(ragged_prefill=True)
    state = SimpleNamespace(prefill=runtime, serve="fastest", prefill_chooser=PrefillChooser())
    model = SimpleNamespace(calib_attention=state, config=SimpleNamespace(num_hidden_layers=2))

    def generate():  # call 1: both layers ran the method; call 2: layer 1 dense; call 3: method off
        for layer in range(2):
            state.prefill_chooser.run("sig", q, q, lambda: q, lambda: q)
        state.prefill_chooser.run("sig", q, q, lambda: q, lambda: q)
        state.prefill_chooser.run("sig", q, q, lambda: None, lambda: q)

    note = bench.ragged_prefill_layers(model, generate, [[100, 101, 40]])
    assert note == "prefill layers of 2 calls: 3 method, 1 dense, 0 method off"
    runtime.ragged_prefill = False  # each row alone: three calls, two layers of one ran with the method off
    assert bench.ragged_prefill_layers(model, generate, [[100, 101, 40]]) == \
        "prefill layers of 3 calls: 3 method, 1 dense, 2 method off"
    # the traffic row's batches: one of lengths 7, 7 (one call) and one of 40, 100 (two calls, alone or not)
    assert bench.ragged_prefill_layers(model, generate, [[7, 7], [40, 100]]) == \
        "prefill layers of 3 calls: 3 method, 1 dense, 2 method off"
    assert bench.ragged_prefill_layers(SimpleNamespace(calib_attention=None), generate, [[1, 2]]) == ""


def test_the_traffic_note_says_in_how_many_layers_the_decode_method_ran():
    """30 layers, the policy serving 27 dense at the last view: the method ran in 3; a prefill-only method
    (no decode runtime) or nothing attached: nothing to say."""
    config = SimpleNamespace(num_hidden_layers=30)
    state = SimpleNamespace(decode="santa", serve_dense=frozenset(range(27)))
    assert bench.decode_layers(SimpleNamespace(calib_attention=state, config=config)) == \
        "decode method in 3 of 30 layers at the last step"
    state.decode = None
    assert bench.decode_layers(SimpleNamespace(calib_attention=state, config=config)) == ""
    assert bench.decode_layers(SimpleNamespace(config=config)) == ""


def test_profile_writes_the_method_and_the_in_process_dense_tables(tmp_path):
    """One profiled prefill each way: the method's path, then the same with its prefill switched off (the
    runtime really off during the second, back on after); without a method, one table."""
    seen = []
    state = SimpleNamespace(prefill="sale", decode=None)
    model = SimpleNamespace(calib_attention=state)

    def prefill():
        seen.append(state.prefill)
        torch.ones(64, 64) @ torch.ones(64, 64)

    bench.profile_prefill(model, prefill, tmp_path / "p" / "ttft.txt")
    text = (tmp_path / "p" / "ttft.txt").read_text()
    assert text.startswith("## method: ") and "## dense in this process: " in text and "aten::mm" in text
    assert seen == ["sale", "sale", None, None] and state.prefill == "sale"
    bench.profile_prefill(SimpleNamespace(calib_attention=None), prefill, tmp_path / "plain.txt")
    assert "dense in this process" not in (tmp_path / "plain.txt").read_text()


def test_saap_top_l_serves_every_layer_at_that_l_and_says_its_rows_are_speed_only(monkeypatch):
    """``--saap-top-l``: the artifact applied with ℓ in every layer (its per-layer profile dropped), each
    saap row noted as speed only; refused beside the artifact's own held-out accuracy, and below 1."""
    seen = {}
    monkeypatch.setattr(bench.hf, "apply", lambda model, path, options=None: seen.update(path=path, options=options))
    monkeypatch.setattr(bench.hf, "remove", lambda model: None)
    setup = bench.setup_of(bench.parse_args(["--artifact", "saap=/a", "--saap-top-l", "16"]))
    bench.attach(object(), "saap", setup)
    assert seen == {"path": "/a", "options": {"saap": {"top_l": 16, "top_l_layers": {}}}}
    bench.attach(object(), "sale", bench.setup_of(bench.parse_args(["--artifact", "sale=/b", "--saap-top-l", "16"])))
    assert seen == {"path": "/b", "options": None}
    for bad in (["--saap-top-l", "0"], ["--saap-top-l", "8", "--accuracy", "saap=eval.json"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_santa_samples_attaches_a_uniform_schedule_with_the_serving_policy_and_says_speed_only(monkeypatch):
    """``--santa-samples S``: SANTA attached without an artifact, S samples in each of the model's layers,
    under the never-slower policy (as ``hf.apply``); listed among the default methods; refused below 1
    and beside a held-out accuracy for santa."""
    seen = {}
    monkeypatch.setattr(bench.hf, "attach", lambda model, decode=None, serve="method": seen.update(rt=decode, serve=serve))
    monkeypatch.setattr(bench.hf, "remove", lambda model: None)
    setup = bench.setup_of(bench.parse_args(["--santa-samples", "2048"]))
    model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=3))
    bench.attach(model, "santa", setup)
    rt = seen["rt"]
    assert seen["serve"] == "fastest" and rt.schedule == [2048, 2048, 2048]
    assert (rt.estimator, rt.tiling, rt.tile) == ("sys", "flash", 256)
    for bad in (["--santa-samples", "0"], ["--santa-samples", "64", "--accuracy", "santa=eval.json"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_unfused_keeps_the_projections_apart_in_every_generator_of_the_run(monkeypatch):
    """``--unfused``: every configuration's loop keeps q/k/v and gate/up as separate GEMMs (the A/B of
    StaticGenerator's fusing, which is on by default)."""
    built = []
    monkeypatch.setattr(bench, "StaticGenerator", lambda model, **kw: built.append(kw) or SimpleNamespace())
    for argv, fused in (([], True), (["--unfused"], False)):
        bench.generator(object(), 2, 64, False, "dense", bench.setup_of(bench.parse_args(argv)))
        assert built[-1]["fuse_projections"] is fused
