"""Figures of a SALE calibration: layer x head heatmaps, sparsity vs length, sparsity vs theta.

Plain ``matplotlib.figure.Figure`` objects (no pyplot state, no GUI backend); the recipe logs them with
:func:`calib.tracking.log_figure`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

_ANNOTATE_MAX_CELLS = 256


def _annotate(ax, values: np.ndarray, fmt: str, norm) -> None:
    if values.size > _ANNOTATE_MAX_CELLS:
        return
    for (i, j), v in np.ndenumerate(values):
        dark = norm(v) < 0.6 if np.isfinite(v) else False  # viridis/magma: light text on dark cells
        ax.text(j, i, format(v, fmt), ha="center", va="center", fontsize=7, color="white" if dark else "black")


def _figure(values: np.ndarray) -> Figure:
    return Figure(figsize=(max(4.5, 0.4 * values.shape[1] + 2.5), max(3.2, 0.3 * values.shape[0] + 2.0)),
                  layout="constrained")


def _layer_head_axes(ax, values: np.ndarray, title: str) -> None:
    layers, heads = values.shape
    ax.set(xlabel="query head", ylabel="layer")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(heads) if heads <= 32 else range(0, heads, max(1, heads // 16)))
    ax.set_yticks(range(layers) if layers <= 32 else range(0, layers, max(1, layers // 16)))


def heatmap(values: torch.Tensor, title: str, cbar_label: str, *, vmin: float | None = None,
            vmax: float | None = None, fmt: str = ".2f") -> Figure:
    """``values: [L, H]`` as a layer (rows) x query head (columns) heatmap."""
    data = values.detach().cpu().double().numpy()
    fig = _figure(data)
    ax = fig.add_subplot()
    im = ax.imshow(data, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
    _annotate(ax, data, fmt, im.norm)
    _layer_head_axes(ax, data, title)
    fig.colorbar(im, ax=ax, label=cbar_label)
    return fig


def tau_heatmap(tau: torch.Tensor, title: str) -> Figure:
    """Per-head tau ``[L, H]`` on a log color scale; dense heads (tau = 0) are grey and marked "D"."""
    data = tau.detach().cpu().double().numpy()
    masked = np.ma.masked_where(data <= 0, data)
    fig = _figure(data)
    ax = fig.add_subplot()
    ax.set_facecolor("0.8")
    positive = data[data > 0]
    norm = LogNorm(vmin=positive.min(), vmax=max(positive.max(), positive.min() * 1.0001)) if positive.size else None
    im = ax.imshow(masked, aspect="auto", cmap="magma", norm=norm, interpolation="nearest")
    if data.size <= _ANNOTATE_MAX_CELLS:
        for (i, j), v in np.ndenumerate(data):
            light = v <= 0 or (norm is not None and norm(v) > 0.6)
            ax.text(j, i, "D" if v <= 0 else f"{v:.0e}", ha="center", va="center", fontsize=6,
                    color="black" if light else "white")
    _layer_head_axes(ax, data, title + "\n(grey D = dense, tau = 0)")
    if positive.size:
        fig.colorbar(im, ax=ax, label="tau")
    return fig


def sparsity_vs_length(lengths: Sequence[int], mean: Sequence[float], std: Sequence[float], title: str) -> Figure:
    """Mean (± std over prompts) block sparsity at each prompt length."""
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    ax.errorbar(list(lengths), list(mean), yerr=list(std), marker="o", capsize=3)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(lengths), [str(n) for n in lengths])
    ax.minorticks_off()
    ax.set(xlabel="prompt length (tokens)", ylabel="block sparsity (1 - kept/causal)", ylim=(0, 1))
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    return fig


def sparsity_vs_theta(thetas: Sequence[float], sparsity: Sequence[float], title: str,
                      mark: float | None = None) -> Figure:
    """Mean block sparsity against the error bound theta (log x axis); ``mark`` = the configured theta."""
    fig = Figure(figsize=(5.5, 3.8), layout="constrained")
    ax = fig.add_subplot()
    order = np.argsort(thetas)
    ax.plot(np.asarray(thetas)[order], np.asarray(sparsity)[order], marker="o")
    if mark is not None:
        ax.axvline(mark, color="grey", linestyle="--", label=f"theta = {mark:g}")
        ax.legend()
    ax.set_xscale("log")
    ax.set(xlabel="error bound theta", ylabel="mean block sparsity", ylim=(0, 1))
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    return fig
