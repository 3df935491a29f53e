"""Plots to PNG with matplotlib (Agg backend: no display needed)."""
from __future__ import annotations

from typing import Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def attention_heatmap(probs: np.ndarray, path: str, labels: Optional[Sequence[str]] = None,
                      title: str = "", query_offset: int = 0, key_offset: int = 0) -> None:
    """One head's [queries, keys] probabilities as a heatmap."""
    fig, ax = plt.subplots(figsize=(6, 5.4))
    im = ax.imshow(probs, cmap="viridis", vmin=0.0, vmax=max(1e-9, float(np.nanmax(probs))),
                   interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    nq, nk = probs.shape
    if labels is not None and max(nq, nk) <= 40:
        ax.set_xticks(range(nk), [labels[key_offset + k] for k in range(nk)], rotation=90,
                      fontsize=7)
        ax.set_yticks(range(nq), [labels[query_offset + q] for q in range(nq)], fontsize=7)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attention_grid(maps, path: str, title: str = "") -> None:
    """Every (layer, head) of a kvlens.AttentionMaps as a grid of small heatmaps."""
    nl, nh = maps.probs.shape[:2]
    fig, axes = plt.subplots(nl, nh, figsize=(1.8 * nh, 1.8 * nl), squeeze=False)
    for i in range(nl):
        for j in range(nh):
            ax = axes[i][j]
            ax.imshow(maps.probs[i, j], cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(f"head {maps.heads[j]}", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"layer {maps.layers[i]}", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def saliency_bar(saliency: Sequence[float], path: str, labels: Optional[Sequence[str]] = None,
                 title: str = "input x gradient") -> None:
    s = np.asarray(saliency, dtype=float)
    fig, ax = plt.subplots(figsize=(max(4, 0.35 * len(s)), 3.2))
    ax.bar(range(len(s)), s, color=np.where(s >= 0, "tab:blue", "tab:red"))
    if labels is not None:
        ax.set_xticks(range(len(s)), labels, rotation=90, fontsize=7)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def head_score_grid(scores: np.ndarray, path: str, title: str = "",
                    layers: Optional[Sequence[int]] = None,
                    heads: Optional[Sequence[int]] = None, vmax: Optional[float] = None) -> None:
    """A [layers, heads] score grid (e.g. induction scores), each cell annotated."""
    nl, nh = scores.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * nh, 1.0 + 0.75 * nl))
    im = ax.imshow(scores, cmap="magma", vmin=0.0, vmax=vmax or max(1e-9, float(np.nanmax(scores))))
    ax.set_xticks(range(nh), heads if heads is not None else range(nh))
    ax.set_yticks(range(nl), layers if layers is not None else range(nl))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    for i in range(nl):
        for j in range(nh):
            v = scores[i, j]
            ax.text(j, i, f"{v:.3f}", ha="center", va="center", fontsize=8,
                    color="white" if v < 0.6 * (vmax or np.nanmax(scores)) else "black")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
