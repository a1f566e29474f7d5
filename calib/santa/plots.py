"""Figures of a SANTA REINFORCE run, built from the files in ``rl.dir`` (history records, snapshots).

* :func:`reward_curve` — mean episode reward per committed iteration (+ a moving average);
* :func:`policy_heatmap` — ``p = softmax(theta)`` per layer (rows) after each iteration (columns);
* :func:`schedule_bars` — the learned artifact schedule next to the uniform one at the same N.

Each returns a matplotlib figure (Agg backend); :func:`log_run_figures` logs all three to the active
MLflow run under ``plots/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from calib.santa.inbox import Layout, read_json
from calib.santa.policy import softmax
from calib.tracking import log_figure

# matplotlib is imported in pyplot() only, which selects the Agg backend before pyplot loads.


@dataclass(frozen=True)
class RunHistory:
    """Per committed iteration k = 1..K: mean reward, result count and p after the update."""

    iterations: np.ndarray  # [K] int
    reward_mean: np.ndarray  # [K]
    num_results: np.ndarray  # [K] int
    probs: np.ndarray  # [K + 1, L]: row 0 is the initial policy (uniform)


def read_history(rl_dir: Path, num_layers: int) -> RunHistory:
    """Load ``history/<k>.json`` for every committed iteration (ascending)."""
    layout = Layout(Path(rl_dir))
    records = []
    if layout.history.exists():
        for p in layout.history.iterdir():
            if p.suffix == ".json" and p.stem.isdigit():
                records.append(read_json(p))
    records.sort(key=lambda r: r["iteration"])
    probs = [np.full(num_layers, 1.0 / num_layers)] + [softmax(np.asarray(r["theta_after"])) for r in records]
    return RunHistory(
        iterations=np.asarray([r["iteration"] for r in records], dtype=np.int64),
        reward_mean=np.asarray([float(np.mean(r["rewards"])) for r in records], dtype=np.float64),
        num_results=np.asarray([len(r["result_ids"]) for r in records], dtype=np.int64),
        probs=np.stack(probs),
    )


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (figures go to files, never to a screen)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def reward_curve(history: RunHistory, window: int = 10) -> Any:
    """Mean reward per iteration and its trailing moving average."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x, y = history.iterations, history.reward_mean
    ax.plot(x, y, ".", alpha=0.5, label="mean reward of the iteration's episodes")
    if len(y):
        w = max(1, min(window, len(y)))
        smooth = np.array([y[max(0, i - w + 1):i + 1].mean() for i in range(len(y))])  # trailing mean
        ax.plot(x, smooth, "-", label=f"moving average ({w})")
    ax.set(xlabel="REINFORCE iteration", ylabel="reward (fraction correct)", ylim=(-0.02, 1.02),
           title="SANTA reward during training")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def policy_heatmap(history: RunHistory) -> Any:
    """Layers x iterations heatmap of the policy's per-layer probability p."""
    plt = pyplot()
    probs = history.probs.T  # [L, K + 1]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.3 * probs.shape[0]))
    im = ax.imshow(probs, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                   extent=(-0.5, probs.shape[1] - 0.5, -0.5, probs.shape[0] - 0.5))
    ax.set(xlabel="REINFORCE iteration", ylabel="layer", title="per-layer share p = softmax(theta)")
    fig.colorbar(im, ax=ax, label="p")
    fig.tight_layout()
    return fig


def schedule_bars(learned: Sequence[int], uniform: Sequence[int]) -> Any:
    """Learned vs uniform per-layer sample budgets (same total N)."""
    plt = pyplot()
    layers = np.arange(len(learned))
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * len(learned) + 2), 3.5))
    ax.bar(layers - 0.2, uniform, width=0.4, label=f"uniform (N={int(np.sum(uniform))})", color="0.7")
    ax.bar(layers + 0.2, learned, width=0.4, label="learned", color="C0")
    ax.set(xlabel="layer", ylabel="samples S", title="SANTA per-layer sample schedule", xticks=layers)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def log_run_figures(rl_dir: Path, num_layers: int, learned: Sequence[int], uniform: Sequence[int]) -> RunHistory:
    """Log the three figures to the active MLflow run (``plots/santa_*.png``); returns the history."""
    history = read_history(rl_dir, num_layers)
    log_figure(reward_curve(history), "plots/santa_reward_curve.png")
    log_figure(policy_heatmap(history), "plots/santa_policy_heatmap.png")
    log_figure(schedule_bars(learned, uniform), "plots/santa_schedule.png")
    return history
