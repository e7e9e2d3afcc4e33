"""Perplexity at and beyond the training length, overall and by position in the window.

Notation: B batch, L evaluation window length.

The sums are torchmetrics states reduced by ``sum``, so the numbers are the same
on one process and under DDP (each rank sees a shard of the windows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import matplotlib

matplotlib.use("Agg")  # figures are written to files and TensorBoard, never shown

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from torch import Tensor
from torchmetrics import Metric

PROTOCOLS = {"nonoverlap": "ppl", "sliding": "ppl_sw"}


class TokenNLL(Metric):
    """Summed negative log-likelihood of scored tokens, overall and per window position.

    Args:
        length: Window length L (size of the per-position sums).
    """

    full_state_update = False
    nll: Tensor
    count: Tensor
    pos_nll: Tensor
    pos_count: Tensor

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length
        self.add_state("nll", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("pos_nll", torch.zeros(length, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("pos_count", torch.zeros(length, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, nll: Tensor, mask: Tensor) -> None:
        """Add a batch.

        Args:
            nll: ``(B, L)`` per-token negative log-likelihood (nats).
            mask: ``(B, L)`` bool, True where the token is scored.
        """
        if nll.shape[-1] != self.length:
            raise ValueError(f"TokenNLL for length {self.length} got windows of {nll.shape[-1]}")
        nll = nll.double() * mask
        m = mask.double()
        self.nll += nll.sum()
        self.count += m.sum()
        self.pos_nll += nll.sum(0)
        self.pos_count += m.sum(0)

    def compute(self) -> dict[str, Tensor]:
        """``loss`` (mean NLL), ``ppl``, ``tokens`` and ``loss_by_position`` (L,)."""
        loss = self.nll / self.count.clamp(min=1)
        return {
            "loss": loss,
            "ppl": loss.exp(),
            "tokens": self.count,
            "loss_by_position": self.pos_nll / self.pos_count.clamp(min=1),
        }


def metric_name(split: str, protocol: str, length: int, extension: str | None = None) -> str:
    """``test/ppl@512`` (non-overlapping windows) or ``test/ppl_sw@512`` (sliding); with a
    RoPE context-extension method, ``test/ppl+yarn@512``."""
    kind = PROTOCOLS[protocol] + (f"+{extension}" if extension else "")
    return f"{split}/{kind}@{length}"


def parse_metric(name: str) -> tuple[str, str, str, str]:
    """``test/ppl_sw+yarn@512`` -> ``("test", "ppl_sw", "yarn", "512")``; the extension is
    ``""`` for a plain run and the last part ``""`` for a name without ``@``."""
    head, _, where = name.partition("@")
    split, _, kind = head.partition("/")
    base, _, extension = kind.partition("+")
    return split, base, extension, where


def ppl_vs_length_figure(
    ppl: Mapping[str, Mapping[int, float]], train_len: int, title: str = ""
) -> Figure:
    """Perplexity against evaluation length, one line per protocol (or encoder).

    Args:
        ppl: Label -> {length: perplexity}; NaN marks a length that was not run.
        train_len: Training context, drawn as a vertical line.
        title: Figure title.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, curve in ppl.items():
        xs = sorted(curve)
        ax.plot(xs, [curve[x] for x in xs], marker="o", label=label)
    ax.axvline(train_len, color="grey", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("evaluation length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def loss_by_position_figure(
    curves: Mapping[str, list[float]], train_len: int, title: str = "", points: int = 256
) -> Figure:
    """Mean loss by token position within the window (where extrapolation breaks).

    Args:
        curves: Label -> per-position mean loss.
        train_len: Training context, drawn as a vertical line.
        title: Figure title.
        points: Curves are averaged into at most this many bins, for readability.
    """
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, ys in curves.items():
        xs, vals = _bin(ys, points)
        ax.plot(xs, vals, label=label, linewidth=1.2)
    ax.axvline(train_len, color="grey", linestyle="--", label=f"train length {train_len}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in window")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _bin(ys: list[float], points: int) -> tuple[list[float], list[float]]:
    """Average a long curve into at most ``points`` log-spaced bins (positions 1-based)."""
    n = len(ys)
    if n <= points:
        return [float(i + 1) for i in range(n)], list(ys)
    edges = sorted({int(round(math.exp(math.log(n) * k / points))) for k in range(points + 1)})
    edges = [0] + [e for e in edges if e > 0]
    xs, vals = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        chunk = [y for y in ys[a:b] if math.isfinite(y)]
        if chunk:
            xs.append((a + b + 1) / 2)
            vals.append(sum(chunk) / len(chunk))
    return xs, vals
