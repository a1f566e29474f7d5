"""SAAP calibration report: the per-ℓ table, interpolated recall, plots and loss curves (docs/methods.md, SAAP).

Input: one :class:`calib.saap.metrics.LayerEvaluation` per evaluated (non-dense) layer, all held-out
prompts joined on the query axis. Aggregation, in this order:

1. per (layer, query head, method, ℓ): mean over the evaluation queries -> one curve point per head
   (:func:`head_curves`, ``[n_layers, n_ℓ, Hq]``);
2. the table (:func:`summary_table`): per method and ℓ, the mean over layers and heads of
   ``selectivity`` (candidates visited / keys outside the dense window, the paper's Table 5),
   ``selectivity_with_window`` (visited / all visible keys), ``recall`` and ``rel_error``;
3. recall at target selectivities (:func:`interpolated_recall`): per (layer, head) the curve
   ``[(0, window recall), (selectivity(ℓ), recall(ℓ)) for ℓ]`` (every method visits exactly the
   window at ℓ = 0) interpolated linearly at each target, then averaged over the heads of all
   evaluated layers (NaN points, outside a head's measured range, are left out of the mean). The
   ``window`` method (StreamingLLM) has no ℓ: its recall is reported at every target unchanged.

Metric names avoid ``@`` (MLflow accepts only ``[/\\w.\\- :]``): ``recall_at_sel0.05.saap``.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import mlflow
import numpy as np
import torch
from matplotlib.figure import Figure
from mlflow.entities import Metric

from calib.saap.metrics import LayerEvaluation, recall_at_selectivity
from calib.tracking import log_figure

METHODS = ("saap", "saap_per_head", "kmeans_derope", "kmeans_rope", "kmeans_derope_group",
           "kmeans_rope_group", "oracle_derope", "oracle_rope")  # the ℓ-indexed methods; "window" is ℓ = 0
NAMES = ("selectivity", "selectivity_with_window", "recall", "rel_error")
LABELS = {"saap": "SAAP (group sum, as the runtime)", "saap_per_head": "SAAP, per-head ranking",
          "kmeans_derope_group": "k-means, de-RoPE'd, group probe", "kmeans_rope_group": "k-means, RoPE'd, group probe",
          "kmeans_derope": "k-means, de-RoPE'd",
          "kmeans_rope": "k-means, RoPE'd", "window": "dense window only",
          "oracle_derope": "oracle: de-RoPE'd buckets by true mass", "oracle_rope": "oracle: RoPE'd buckets by true mass"}


def target_key(t: float) -> str:
    """``0.05`` -> ``"recall_at_sel0.05"`` (the metric prefix for one target selectivity)."""
    return f"recall_at_sel{t:g}"


def head_curves(evals: dict[int, LayerEvaluation], long_range: int | None = None, longer: bool = True
                ) -> dict[str, dict[str, torch.Tensor]]:
    """``{method: {metric: [n_layers, n_ℓ, Hq]}}`` (``n_ℓ = 1`` for ``window``), means over queries.

    Layers are stacked in ascending order of their index. With ``long_range``: only the (head, query)
    pairs whose top-1 key lies more than ``long_range`` tokens back (``longer``; else the others), from
    :attr:`LayerEvaluation.top1_distance`; a head with no such query gets NaN (left out of the means).
    """
    layers = sorted(evals)
    methods = evals[layers[0]].metrics

    def mean(l: int, v: torch.Tensor) -> torch.Tensor:  # [n_ℓ, Hq, nq] -> [n_ℓ, Hq]
        if long_range is None:
            return v.double().mean(-1)
        dist = evals[l].top1_distance
        if dist is None:
            raise ValueError(f"layer {l}'s evaluation has no top-1 distances to split the queries by")
        keep = ((dist > long_range) == longer).double()  # [Hq, nq]
        return (v.double() * keep).sum(-1) / keep.sum(-1)  # 0 / 0 = NaN: no such query

    return {m: {k: torch.stack([mean(l, evals[l].metrics[m][k]) for l in layers]) for k in d}
            for m, d in methods.items()}


def summary_table(curves: dict[str, dict[str, torch.Tensor]], top_ls: Sequence[int]) -> list[dict[str, Any]]:
    """Rows ``{method, l, selectivity, selectivity_with_window, recall, rel_error}`` (means over heads)."""
    rows = []
    for method, d in curves.items():
        ells = [0] if method == "window" else list(top_ls)
        for i, ell in enumerate(ells):
            rows.append({"method": method, "l": int(ell), **{k: float(d[k][:, i].mean()) for k in NAMES if k in d}})
    return rows


def interpolated_recall(curves: dict[str, dict[str, torch.Tensor]], targets: Sequence[float],
                        per_layer: bool = False) -> dict[str, Any]:
    """Recall at each target selectivity, per method: ``{method: [value per target]}``.

    With ``per_layer``: ``{method: [[value per target] per layer]}`` (heads averaged within a layer).
    """
    window = curves["window"]["recall"][:, 0]  # [n_layers, Hq]
    n_layers, hq = window.shape
    out: dict[str, Any] = {}
    for method in (m for m in METHODS if m in curves):
        sel, rec = curves[method]["selectivity"], curves[method]["recall"]  # [n_layers, n_ℓ, Hq]
        vals = np.full((n_layers, hq, len(targets)), np.nan)
        for layer in range(n_layers):
            for h in range(hq):
                s = [0.0, *sel[layer, :, h].tolist()]
                r = [float(window[layer, h]), *rec[layer, :, h].tolist()]
                vals[layer, h] = recall_at_selectivity(s, r, targets)
        out[method] = _nanmean(vals, per_layer)
    win = np.repeat(window.numpy()[..., None], len(targets), -1)
    out["window"] = _nanmean(win, per_layer)
    return out


def recall_by_query_range(evals: dict[int, LayerEvaluation], long_range: int, targets: Sequence[float]
                          ) -> dict[str, Any]:
    """Interpolated recall (:func:`interpolated_recall`) over two disjoint sets of the evaluation's (head,
    query) pairs: ``long_range``, whose top-1 key lies more than ``long_range`` tokens back — the queries
    the classifiers are trained on (Mazaré et al., arXiv:2502.08246, §4, App. A) — and ``short_range``,
    the rest (their top key in or near the dense window). ``{range: {"fraction": share of the pairs,
    target_key(t): {method: recall}}}``: where SAAP's deficit against the k-means baselines comes from."""
    dist = torch.cat([e.top1_distance.flatten() for e in evals.values()])
    out: dict[str, Any] = {}
    for name, longer in (("long_range", True), ("short_range", False)):
        interp = interpolated_recall(head_curves(evals, long_range, longer), targets)
        out[name] = {"fraction": float(((dist > long_range) == longer).double().mean()),
                     **{target_key(t): {m: v[i] for m, v in interp.items()} for i, t in enumerate(targets)}}
    return out


def json_safe(x: Any) -> Any:
    """NaN -> None, recursively through lists and dicts (strict JSON for manifests and MLflow)."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


def _nanmean(vals: np.ndarray, per_layer: bool) -> list:
    """Mean over heads (and layers unless ``per_layer``) ignoring NaN; all-NaN -> NaN."""
    axes = (1,) if per_layer else (0, 1)
    ok = ~np.isnan(vals)
    total = np.where(ok, vals, 0.0).sum(axes)
    count = ok.sum(axes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).tolist()


def headline_metrics(curves: dict[str, dict[str, torch.Tensor]], top_ls: Sequence[int],
                     top_l: int | Sequence[int], targets: Sequence[float]) -> dict[str, Any]:
    """Nested metrics: ``recall_at_sel<t>.<method>`` for all four methods and ``at_top_l.<metric>.<method>``:
    every method at the artifact's default ℓ, one ℓ for all layers or one per layer (in the curves' layer
    order, ``top_l_layers``), averaged over the layers' heads."""
    out: dict[str, Any] = {}
    interp = interpolated_recall(curves, targets)
    for i, t in enumerate(targets):
        out[target_key(t)] = {m: v[i] for m, v in interp.items()}
    n_layers = curves["window"]["recall"].shape[0]
    per_layer = [int(top_l)] * n_layers if isinstance(top_l, int) else [int(x) for x in top_l]
    if len(per_layer) != n_layers:
        raise ValueError(f"{len(per_layer)} default ℓ for {n_layers} evaluated layers")
    cols = [list(top_ls).index(x) for x in per_layer]

    def at_default(v: torch.Tensor) -> float:  # [n_layers, n_ℓ, Hq] -> mean over layers and heads
        return float(torch.stack([v[j, c] for j, c in enumerate(cols)]).mean())

    out["at_top_l"] = {k: {m: at_default(curves[m][k]) for m in METHODS if m in curves} for k in NAMES}
    out["window"] = {k: float(curves["window"][k].mean()) for k in ("selectivity_with_window", "recall", "rel_error")}
    return out


# ------------------------------------------------------------------------------------------- figures
def tradeoff_figure(rows: list[dict[str, Any]], y: str, title: str) -> Figure:
    """Two panels, ``y`` vs selectivity outside the window (left, the paper's) and with it (right).

    One line per ℓ-method with points labelled by ℓ; the window alone is a dashed horizontal line.
    """
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2)
    window = next(r for r in rows if r["method"] == "window")
    for ax, x in zip(axes, ("selectivity", "selectivity_with_window")):
        for method in METHODS:
            pts = [r for r in rows if r["method"] == method]
            if not pts:
                continue
            xs, ys = [r[x] for r in pts], [r[y] for r in pts]
            ax.plot(xs, ys, marker="o", label=LABELS[method])
            for r in pts:
                ax.annotate(str(r["l"]), (r[x], r[y]), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax.axhline(window[y], color="grey", linestyle="--", label=LABELS["window"])
        ax.set_xscale("log")
        ax.set(xlabel=x.replace("_", " "), ylabel=y.replace("_", " "))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def moving_average(x: np.ndarray, width: int) -> np.ndarray:
    """Trailing mean over ``width`` steps along axis 0 (shorter at the start): ``[steps, ...]``."""
    c = np.cumsum(np.concatenate([np.zeros_like(x[:1]), x]), 0)
    idx = np.arange(1, x.shape[0] + 1)
    lo = np.maximum(idx - width, 0)
    return (c[idx] - c[lo]) / (idx - lo).reshape(-1, *([1] * (x.ndim - 1)))


def loss_figure(curves: dict[int, torch.Tensor], title: str) -> Figure:
    """Classifier KL loss per step, one panel per layer.

    Batches come from one prompt each, so the raw loss jumps with the prompt: the head mean is drawn
    raw (light) and as a moving average over ``steps / 20`` steps (bold), each head's average faint.
    """
    layers = sorted(curves)
    cols = min(4, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig = Figure(figsize=(3.6 * cols, 2.8 * rows))
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for ax, layer in zip(axes, layers):
        c = curves[layer].double().numpy()  # [steps, Hq]
        width = max(1, c.shape[0] // 20)
        ax.plot(c.mean(1), color="grey", alpha=0.35, linewidth=0.6)
        ax.plot(moving_average(c, width), color="tab:blue", alpha=0.3, linewidth=0.6)
        ax.plot(moving_average(c.mean(1), width), color="black", linewidth=1.4)
        ax.set(title=f"layer {layer}", xlabel="step", ylabel="KL")
    for ax in axes[len(layers):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------- mlflow
def log_loss_series(curves: dict[int, torch.Tensor], max_points: int = 500) -> None:
    """Log ``classifier_loss.layer<l>`` (mean over heads) per step to the active run, in batches."""
    run = mlflow.active_run()
    if run is None:
        return
    now = int(time.time() * 1000)
    metrics = []
    for layer, c in sorted(curves.items()):
        mean = c.double().mean(1)
        stride = max(1, math.ceil(mean.numel() / max_points))
        steps = sorted(set(range(0, mean.numel(), stride)) | {mean.numel() - 1})
        metrics += [Metric(f"classifier_loss.layer{layer}", float(mean[s]), now, s) for s in steps]
    client = mlflow.MlflowClient()
    for start in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[start:start + 1000])


def log_report(rows: list[dict[str, Any]], loss_curves: dict[int, torch.Tensor], model_name: str,
               extra: dict[str, Any]) -> None:
    """Table (``saap/eval_table.json``), trade-off plots and loss curves to the active run."""
    if mlflow.active_run() is None:
        return
    mlflow.log_dict(json_safe({"rows": rows, **extra}), "saap/eval_table.json")
    log_figure(tradeoff_figure(rows, "recall", f"SAAP {model_name}: attention recall vs selectivity"),
               "plots/saap_recall_vs_selectivity.png")
    log_figure(tradeoff_figure(rows, "rel_error", f"SAAP {model_name}: output relative error vs selectivity"),
               "plots/saap_error_vs_selectivity.png")
    if loss_curves:
        log_figure(loss_figure(loss_curves, f"SAAP {model_name}: classifier KL loss"),
                   "plots/saap_classifier_loss.png")
        log_loss_series(loss_curves)


def layer_profile_figure(rows: list[dict[str, Any]], dense_acc: float, title: str) -> Figure:
    """The per-layer ℓ profile's trials (:meth:`calib.saap.layer_profile.ProfileResult.table`): profiling
    accuracy vs selectivity, each point labelled by its step, dense's accuracy a dashed line."""
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    ax.plot([r["selectivity"] for r in rows], [r["acc"] for r in rows], "o", color="tab:blue")
    for r in rows:
        ax.annotate(r["step"], (r["selectivity"], r["acc"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.axhline(dense_acc, color="grey", linestyle="--", label="dense")
    ax.set(xlabel="selectivity (keys read beyond the window)", ylabel="profiling accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def log_layer_profile(rows: list[dict[str, Any]], dense_acc: float, model_name: str) -> None:
    """The profile's trials (``saap/layer_profile.json``) and their plot to the active run."""
    if mlflow.active_run() is None:
        return
    mlflow.log_dict(json_safe({"dense_acc": dense_acc, "trials": rows}), "saap/layer_profile.json")
    log_figure(layer_profile_figure(rows, dense_acc, f"SAAP {model_name}: per-layer ℓ profile"),
               "plots/saap_layer_profile.png")
