"""``python -m calib run +method=sale``: per (layer, query head) thresholds tau by tau-halving (docs/methods.md, SALE).

Stages, each timed; stages 2 and 3 and the theta curve are report extras (``method.report=full`` only):

1. ``calibrate`` — ``num_samples`` calibration prompts of ``calib_length`` tokens (default: the longest
   data length) run through the DENSE model once each; per (layer, prompt) every head's error
   ``Err(tau) = ||O - O~||_1 / N`` against the model's own attention output and its density are recorded
   at every tau of the halving ladder (:func:`collect_tables`). Halving then runs per layer on those
   tables (:func:`halve_layers`): a head keeps the first tau whose error is ``<= theta`` on EVERY
   sample; ``tau <= tau_min`` becomes 0 (dense).
2. ``sparsity_by_length`` — block sparsity of the calibrated tau on held-out prompts (``eval.seed``)
   of every data length: the Selection-Pass only, on the dense model's inputs (``sparsity_at_<len>``).
3. ``ablation`` (``compare_shared_tau``) — one tau shared by all heads whose mean sparsity on the
   calibration samples matches the per-head result (paper Fig. 3b): worst per-head Err of both, and
   held-out task accuracy of dense / per-head / shared on ``ablation_prompts`` prompts per task at
   ``ablation_length`` (default the calibration length), SALE plugged in with ``runtime_kernels.hf.attach``
   exactly as ``hf.apply`` would. Results: docs/results/sale.md.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from omegaconf import DictConfig

from calib.collect.capture import run_layer_callbacks
from calib.data import build_prompts, dataset_hash
from calib.errors import UserError
from calib.evaluate import answer_prompts
from calib.models import load_model
from calib.recipe_settings import Section, layer_scales, report_mode
from calib.run import MethodOutput
from calib.sale.tables import (LadderEval, at_tau, evaluate_ladder, halve_from_table, match_shared_tau,
                               shared_tau_grid, tau_ladder)
from calib.stats import paired_bootstrap_diff
from calib.tracking import log_figure
from runtime_kernels import hf
from runtime_kernels.manifest import DataRecord
from runtime_kernels.sale.api import SalePrefill, estimator_precision, sale_select
from runtime_kernels.sale.reference import SaleSelectionConfig

# mlflow and calib.sale.plots (matplotlib) are imported where used: the CLI imports this recipe for its
# checks of a run's settings and data, which must fail fast.

BITS = {4: "int4", 8: "int8"}


# ------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Settings:
    """``cfg.method`` read and range-checked once (conf/method/sale/default.yaml documents every key)."""

    theta: float
    tau0: float
    tau_min: float
    selection: SaleSelectionConfig  # bits, block_q, block_k, sink, local
    num_samples: int
    calib_length: int | None
    calib_tasks: list[str] | None
    report: str
    sparsity_prompts: int
    theta_curve: list[float]
    compare_shared_tau: bool
    ablation_prompts: int
    ablation_length: int | None

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Settings":
        m = Section(cfg.method, "method")
        tau0 = m.number("tau0", above=0, at_most=1)
        selection = SaleSelectionConfig(block_q=m.integer("block_q", at_least=1),
                                        block_k=m.integer("block_k", at_least=1), sink=m.integer("sink", at_least=0),
                                        local=m.integer("local", at_least=0), bits=m.choice("bits", tuple(BITS)))
        return cls(theta=m.number("theta", above=0), tau0=tau0, tau_min=m.number("tau_min", at_least=0, below=tau0),
                   selection=selection, num_samples=m.integer("num_samples", at_least=1),
                   calib_length=m.integer("calib_length", optional=True, at_least=1),
                   calib_tasks=m.names("calib_tasks", optional=True), report=report_mode(m),
                   sparsity_prompts=m.integer("sparsity_prompts", at_least=1),
                   theta_curve=m.numbers("theta_curve", optional=True, above=0, empty=True) or [],
                   compare_shared_tau=m.flag("compare_shared_tau"),
                   ablation_prompts=m.integer("ablation_prompts", at_least=0),
                   ablation_length=m.integer("ablation_length", optional=True, at_least=1))

    @property
    def full_report(self) -> bool:
        """The report extras run: sparsity by length, the theta curve, the shared-tau ablation."""
        return self.report == "full"

    @property
    def compare(self) -> bool:
        """The shared-tau ablation runs (a report extra)."""
        return self.full_report and self.compare_shared_tau


def validate(cfg: DictConfig) -> None:
    """Range checks of ``cfg.method`` (one-line :class:`UserError`)."""
    Settings.from_cfg(cfg)


def data_needs(cfg: DictConfig) -> dict[str, str | None]:
    """Calibration and held-out rows; answers only for the accuracy ablation (the errors need none)."""
    s = Settings.from_cfg(cfg)
    return {"calibration": None,
            "evaluation": "SALE's accuracy ablation scores held-out answers (method.ablation_prompts=0 skips it)"
            if s.compare and s.ablation_prompts > 0 else None}


def calibration_length(cfg: DictConfig, s: Settings) -> int:
    return s.calib_length if s.calib_length is not None else max(int(x) for x in cfg.data.lengths)


def calibration_prompts(cfg: DictConfig, s: Settings, tokenizer: Any) -> list[Any]:
    """``num_samples`` prompts (``data.seed``, ``calib_length``), tasks taken in turn."""
    n = s.num_samples
    tasks = [str(t) for t in (s.calib_tasks or cfg.data.tasks or [])]  # file/hub data: [] = every task
    per_task = -(-n // max(1, len(tasks)))
    prompts = build_prompts(cfg.data, tokenizer, seed=int(cfg.data.seed), lengths=[calibration_length(cfg, s)],
                            tasks=tasks, num_prompts=per_task, purpose="calibration")
    by_task: dict[str, list[Any]] = defaultdict(list)
    for p in prompts:
        by_task[p.task].append(p)
    queues = list(by_task.values())
    chosen = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)][:n]
    if len(chosen) < n:
        raise UserError(f"only {len(chosen)} calibration prompts available but method.num_samples={n}; "
                        "lower method.num_samples or provide more data")
    return chosen


# ------------------------------------------------------------------------------------- calibration
@dataclass
class CalibTables:
    """All (layer, sample) ladder evaluations; see :mod:`calib.sale.tables`."""

    ladder: list[float]
    err: torch.Tensor  # [L, K, S, H] float32
    density: torch.Tensor  # [L, K, S, H] float32
    kept: torch.Tensor  # [L, S, H, G] int64 (G = 0 without the shared-tau grid)
    causal: torch.Tensor  # [S] int64


@dataclass
class Calibrated:
    """The halving result of every layer."""

    tau: torch.Tensor  # [L, H] float32, 0 = dense
    err: torch.Tensor  # [S, L, H] float32, Err at the chosen tau per sample
    density: torch.Tensor  # [S, L, H] float32, kept / causal blocks at the chosen tau
    steps: list[int]  # halving evaluations per layer


def collect_tables(loaded: Any, prompts: Sequence[Any], ladder: list[float], sel: SaleSelectionConfig,
                   grid: torch.Tensor | None) -> CalibTables:
    """One dense forward per prompt; per (layer, prompt) every head at every ladder tau.

    The capture callback gets the RoPE'd q, k, v the attention used and O = the model's own per-head
    attention output before ``o_proj`` (``keep_attn_output``), estimates the Selection-Pass block scores
    once and records every head's ``Err(tau)`` and density at every ladder tau (:mod:`calib.sale.tables`).
    Each layer is thus calibrated on the dense model's inputs to that layer (no error cascade), and only
    one layer of one prompt is in memory at a time.

    O vs q/k/v: the stored errors compare with the model's own attention output (SDPA in the model's
    dtype, e.g. bf16 on GPU); O~ is the exact softmax over the kept blocks of the same RoPE'd q, k, v in
    float32 (:func:`calib.sale.tables.ladder_errors_partials`, equal to :func:`block_sparse_attention`).
    At tau = 0 the error is the float noise floor between the two (reported as ``err_dense_floor``); the
    test recomputes every stored error from float64 dense and block-sparse attention.
    """
    n_layers, n_heads, s = loaded.facts.num_layers, loaded.facts.num_heads, len(prompts)
    g = 0 if grid is None else grid.numel()
    err = torch.zeros(n_layers, len(ladder), s, n_heads)
    density = torch.zeros(n_layers, len(ladder), s, n_heads)
    kept = torch.zeros(n_layers, s, n_heads, g, dtype=torch.int64)
    causal = torch.zeros(s, dtype=torch.int64)
    scales = layer_scales(loaded.model)

    def on_layer(cap: Any) -> None:
        ev: LadderEval = evaluate_ladder(cap.q_post, cap.k_post, cap.v, cap.attn_output, ladder, sel,
                                         scale=scales[cap.layer], grid=grid)
        err[cap.layer, :, cap.prompt_index] = ev.err
        density[cap.layer, :, cap.prompt_index] = ev.density
        kept[cap.layer, cap.prompt_index] = ev.kept
        causal[cap.prompt_index] = ev.causal

    run_layer_callbacks(loaded, [p.input_ids for p in prompts], on_layer, keep_attn_output=True,
                        desc="sale calibration")
    return CalibTables(ladder, err, density, kept, causal)


def halve_layers(tables: CalibTables, *, theta: float, tau0: float, tau_min: float) -> Calibrated:
    """tau-halving of every layer on its table (all heads of a layer at once per step)."""
    taus, errs, dens, steps = [], [], [], []
    for layer_err, layer_density in zip(tables.err, tables.density):
        res = halve_from_table(layer_err, tables.ladder, theta=theta, tau0=tau0, tau_min=tau_min)
        taus.append(res.tau)
        errs.append(res.err)  # [S, H]
        dens.append(at_tau(layer_density, tables.ladder, res.tau))  # [S, H]
        steps.append(len(res.trace))
    return Calibrated(torch.stack(taus), torch.stack(errs, 1), torch.stack(dens, 1), steps)


def sparsity_by_length(loaded: Any, prompts: Sequence[Any], tau: torch.Tensor,
                       sel: SaleSelectionConfig) -> dict[int, list[float]]:
    """Per prompt length, each prompt's block sparsity (mean over layers and heads) under ``tau: [L, H]``.

    Selection-Pass only, on the dense model's inputs to each layer.
    """
    scales = layer_scales(loaded.model)
    dens_sum = torch.zeros(len(prompts), dtype=torch.float64)
    count = torch.zeros(len(prompts), dtype=torch.float64)

    def on_layer(cap: Any) -> None:
        row = tau[cap.layer]
        if bool((row == 0).all()):
            d = torch.ones(row.numel(), dtype=torch.float64)
        else:
            mask = sale_select(cap.q_post[None], cap.k_post[None], row.to(cap.q_post.device), config=sel,
                               scale=scales[cap.layer])
            d = mask.density()[0].double().cpu()
        dens_sum[cap.prompt_index] += d.sum()
        count[cap.prompt_index] += d.numel()

    run_layer_callbacks(loaded, [p.input_ids for p in prompts], on_layer, desc="sale sparsity by length")
    out: dict[int, list[float]] = defaultdict(list)
    for p, d in zip(prompts, (dens_sum / count).tolist()):
        out[int(p.length)].append(1.0 - d)
    return dict(sorted(out.items()))


def errors_at_shared_tau(loaded: Any, prompts: Sequence[Any], tau: float,
                         sel: SaleSelectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Err and density ``[S, L, H]`` of one tau shared by every head, on ``prompts``."""
    n_layers, n_heads = loaded.facts.num_layers, loaded.facts.num_heads
    err = torch.zeros(len(prompts), n_layers, n_heads)
    density = torch.zeros(len(prompts), n_layers, n_heads)
    scales = layer_scales(loaded.model)

    def on_layer(cap: Any) -> None:
        ev = evaluate_ladder(cap.q_post, cap.k_post, cap.v, cap.attn_output, [tau], sel, scale=scales[cap.layer])
        err[cap.prompt_index, cap.layer] = ev.err[0]
        density[cap.prompt_index, cap.layer] = ev.density[0]

    run_layer_callbacks(loaded, [p.input_ids for p in prompts], on_layer, keep_attn_output=True,
                        desc="sale shared tau")
    return err, density


def ablation_accuracy(cfg: DictConfig, s: Settings, loaded: Any, taus: dict[str, torch.Tensor],
                      length: int) -> dict[str, float]:
    """Held-out exact-match accuracy dense and with SALE at each ``taus[name]: [L, H]``."""
    prompts = build_prompts(cfg.data, loaded.tokenizer, seed=int(cfg.eval.seed), lengths=[length],
                            tasks=cfg.data.tasks, num_prompts=s.ablation_prompts,
                            purpose="evaluation")
    max_new = int(cfg.eval.max_new_tokens)
    correct = {"dense": np.array([r.correct for r in answer_prompts(loaded, prompts, max_new)], dtype=float)}
    out: dict[str, float] = {}
    for name, tau in taus.items():
        runtime = hf.attach(loaded.model, prefill=SalePrefill(tau, s.selection))
        try:
            res = answer_prompts(loaded, prompts, max_new, runtime=runtime, desc=f"sale {name}")
        finally:
            hf.remove(loaded.model)
        correct[name] = np.array([r.correct for r in res], dtype=float)
        out[f"runtime_sparsity_{name}"] = float(np.mean([r.stats.get("sparsity", 0.0) for r in res]))
    out.update({f"acc_{k}": float(v.mean()) for k, v in correct.items()})
    if "per_head" in correct and "shared" in correct:
        ci = paired_bootstrap_diff(correct["shared"], correct["per_head"], resamples=int(cfg.eval.bootstrap),
                                   seed=int(cfg.seed))
        out.update(acc_diff_per_head_minus_shared=ci.mean, acc_diff_ci_low=ci.low, acc_diff_ci_high=ci.high)
    out["ablation_prompts"] = float(len(prompts))
    return out


# --------------------------------------------------------------------------------------- reporting
def per_head_table(cal: Calibrated, theta: float) -> dict[str, Any]:
    """JSON table of the calibration (logged to MLflow as ``sale/per_head.json``)."""
    return {"theta": theta, "layers": int(cal.tau.shape[0]), "heads": int(cal.tau.shape[1]),
            "tau": cal.tau.tolist(), "sparsity": (1 - cal.density.mean(0)).tolist(),
            "err_max": cal.err.amax(0).tolist(), "err": cal.err.tolist(), "halving_steps": cal.steps}


def log_plots(cal: Calibrated, by_length: dict[int, list[float]], curve: dict[float, float], theta: float,
              model_name: str) -> None:
    """Heatmaps of tau / sparsity / worst error, sparsity vs length and vs theta, to the active run."""
    from calib.sale import plots

    title = f"SALE {model_name}, theta={theta:g}"
    log_figure(plots.tau_heatmap(cal.tau, f"{title}: tau per head"), "plots/sale_tau_heatmap.png")
    log_figure(plots.heatmap(1 - cal.density.mean(0), f"{title}: block sparsity per head", "sparsity",
                             vmin=0.0, vmax=1.0), "plots/sale_sparsity_heatmap.png")
    log_figure(plots.heatmap(cal.err.amax(0) / theta, f"{title}: worst Err / theta over samples", "Err / theta",
                             vmin=0.0, vmax=1.0), "plots/sale_err_heatmap.png")
    if by_length:
        lengths = list(by_length)
        log_figure(plots.sparsity_vs_length(lengths, [float(np.mean(by_length[n])) for n in lengths],
                                            [float(np.std(by_length[n])) for n in lengths],
                                            f"sparsity vs length, {title}"), "plots/sale_sparsity_vs_length.png")
    if len(curve) > 1:
        log_figure(plots.sparsity_vs_theta(list(curve), list(curve.values()),
                                           f"SALE {model_name}: sparsity vs theta (calibration samples)", mark=theta),
                   "plots/sale_sparsity_vs_theta.png")


def log_shared_tau(cal: Calibrated, err_shared: torch.Tensor, dens_shared: torch.Tensor, tau_shared: float,
                   theta: float, model_name: str) -> None:
    """Worst Err per head of the shared tau (heatmap in units of theta, next to ``sale_err_heatmap.png`` of
    the per-head tau) and the raw table."""
    import mlflow

    from calib.sale import plots

    top = float(err_shared.amax(0).max()) / theta
    log_figure(plots.heatmap(err_shared.amax(0) / theta, f"SALE {model_name}: worst Err / theta, one shared "
                             f"tau = {tau_shared:.3g}\n(same mean sparsity as per-head tau)", "Err / theta",
                             vmin=0.0, vmax=max(top, 1.0)), "plots/sale_err_shared_heatmap.png")
    mlflow.log_dict({"tau_shared": tau_shared, "theta": theta, "err_shared": err_shared.tolist(),
                     "sparsity_shared": (1 - dens_shared.mean(0)).tolist()}, "sale/shared_tau.json")


def theta_curve(tables: CalibTables, theta: float, multiples: Sequence[float], tau0: float,
                tau_min: float) -> dict[float, float]:
    """Mean sparsity on the calibration samples at ``theta * multiples`` (and theta), from the tables."""
    out = {}
    for th in sorted({theta, *(theta * float(x) for x in multiples)}):
        out[th] = float(1 - halve_layers(tables, theta=th, tau0=tau0, tau_min=tau_min).density.mean())
    return out


# ------------------------------------------------------------------------------------------- recipe
def calibrate(cfg: DictConfig, ctx: Any) -> MethodOutput:
    """Calibrate per-head tau; returns the :class:`calib.run.MethodOutput` (see the module docstring)."""
    import mlflow

    s = Settings.from_cfg(cfg)
    theta, tau0, tau_min, sel, full = s.theta, s.tau0, s.tau_min, s.selection, s.full_report
    with ctx.timer.stage("load"):
        loaded = load_model(cfg.model, device=str(ctx.device))
        prompts = calibration_prompts(cfg, s, loaded.tokenizer)
    length = calibration_length(cfg, s)
    ladder = tau_ladder(tau0, tau_min)
    grid = shared_tau_grid() if s.compare else None
    with ctx.timer.stage("calibrate"):
        tables = collect_tables(loaded, prompts, ladder, sel, grid)
        cal = halve_layers(tables, theta=theta, tau0=tau0, tau_min=tau_min)
    sparsity = float(1 - cal.density.mean())
    metrics: dict[str, Any] = {
        "theta": theta, "sparsity": sparsity, "density": 1 - sparsity,
        "err_worst": float(cal.err.max()), "dense_head_fraction": float((cal.tau == 0).float().mean()),
        "tau_mean": float(cal.tau.mean()), "err_dense_floor": float(tables.err[:, -1].max()),
        "bound_met": float(bool(((cal.err <= theta) | (cal.tau == 0)[None]).all())),
    }
    curve = theta_curve(tables, theta, s.theta_curve if full else [], tau0, tau_min)
    if full:
        metrics["sparsity_vs_theta"] = {f"{th:g}": v for th, v in curve.items()}
    by_length: dict[int, list[float]] = {}
    if full:
        with ctx.timer.stage("sparsity_by_length"):
            held_out = build_prompts(cfg.data, loaded.tokenizer, seed=int(cfg.eval.seed),
                                     lengths=[int(x) for x in cfg.data.lengths], tasks=cfg.data.tasks,
                                     num_prompts=s.sparsity_prompts, purpose="evaluation")
            by_length = sparsity_by_length(loaded, held_out, cal.tau, sel)
    metrics.update({f"sparsity_at_{n}": float(np.mean(v)) for n, v in by_length.items()})
    # What ran during calibration here (the reference honours 4 bits; the CUDA kernels estimate in int8).
    ran = estimator_precision(sel, next(loaded.model.parameters()).device)
    payload: dict[str, Any] = {"selection": sel.to_dict(), "precision": sel.precision,
                               "calibration_estimator": ran, "cuda_runtime_estimator": "float" if sel.bits is None
                               else "int8", "ladder": ladder,
                               "sparsity_by_length": {str(n): float(np.mean(v)) for n, v in by_length.items()}}
    if s.compare:
        with ctx.timer.stage("ablation"):
            ablation = shared_tau_ablation(cfg, s, loaded, prompts, tables, cal, length)
        metrics["ablation"] = {k: v for k, v in ablation.items() if isinstance(v, float)}
        payload["shared_tau"] = ablation
    mlflow.log_dict(per_head_table(cal, theta), "sale/per_head.json")
    if full:
        mlflow.log_dict({"theta": list(curve), "sparsity": list(curve.values())}, "sale/sparsity_vs_theta.json")
    log_plots(cal, by_length, curve, theta, str(cfg.model.name))
    data = DataRecord(source=str(cfg.data.get("source", "synthetic")), seed=int(cfg.data.seed), count=len(prompts),
                      lengths=sorted({int(p.length) for p in prompts}), content_hash=dataset_hash(prompts),
                      tasks=sorted({p.task for p in prompts}),
                      details={"prompt_ids": [p.prompt_id for p in prompts],
                               "tokens": [len(p.input_ids) for p in prompts], "heldout_seed": int(cfg.eval.seed)})
    hyper = {"theta": theta, "tau0": tau0, "tau_min": tau_min, "bits": sel.bits, "block_q": sel.block_q,
             "block_k": sel.block_k, "sink": sel.sink, "local": sel.local, "smooth_k": sel.smooth_k,
             "num_samples": len(prompts), "calib_length": length,
             "calib_tasks": s.calib_tasks, "precision": sel.precision}
    tensors = {"thresholds": {"tau": cal.tau.float().contiguous(), "err": cal.err.float().contiguous(),
                              "density": cal.density.mean(0).float().contiguous()}}
    return MethodOutput(tensors=tensors, hyperparameters=hyper, model=loaded.facts.to_dict(), data=data,
                        metrics=metrics, payload=payload)


def shared_tau_ablation(cfg: DictConfig, s: Settings, loaded: Any, prompts: Sequence[Any], tables: CalibTables,
                        cal: Calibrated, length: int) -> dict[str, float]:
    """Per-head vs one shared tau at equal mean sparsity (paper Fig. 3b): worst Err and accuracy."""
    theta = s.theta
    target = float(cal.density.mean())
    tau_shared, predicted = match_shared_tau(tables.kept, tables.causal, shared_tau_grid(), target)
    err_shared, dens_shared = errors_at_shared_tau(loaded, prompts, tau_shared, s.selection)
    log_shared_tau(cal, err_shared, dens_shared, tau_shared, theta, str(cfg.model.name))
    out = {"tau_shared": tau_shared, "sparsity_per_head": 1 - target, "sparsity_shared": float(1 - dens_shared.mean()),
           "sparsity_shared_predicted": 1 - predicted,
           "err_worst_per_head": float(cal.err.max()), "err_worst_shared": float(err_shared.max()),
           "heads_over_theta_per_head": float((cal.err.amax(0) > theta).float().mean()),
           "heads_over_theta_shared": float((err_shared.amax(0) > theta).float().mean())}
    if s.ablation_prompts > 0:
        shared = torch.full_like(cal.tau, tau_shared)
        acc_length = s.ablation_length or length
        out.update(ablation_accuracy(cfg, s, loaded, {"per_head": cal.tau, "shared": shared}, acc_length))
        out["ablation_length"] = float(acc_length)
    return out
