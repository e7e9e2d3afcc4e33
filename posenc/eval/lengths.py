"""Perplexity at and beyond the training length, overall and by position in the window.

Notation: B batch, L evaluation window length.

The sums are torchmetrics states reduced by ``sum``, so the numbers are the same
on one process and under DDP (each rank sees a shard of the windows).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from posenc.results import MetricName

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
    RoPE context-extension method, ``test/ppl+yarn@512`` (a :class:`MetricName`)."""
    return MetricName.of(split, PROTOCOLS[protocol], length, extension or "")


def describe_metric(name: str) -> str:
    """``test/ppl+yarn@512`` -> ``test ppl+yarn@512 nonoverlap``: a metric name with its
    protocol spelled out (what a progress line or bar says it is evaluating)."""
    split, base, _, _ = parse_metric(name)
    protocol = {v: k for k, v in PROTOCOLS.items()}.get(base)
    head = name.replace("/", " ", 1) if split else name
    return f"{head} {protocol}" if protocol else head


def parse_metric(name: str) -> tuple[str, str, str, str]:
    """``test/ppl_sw+yarn@512`` -> ``("test", "ppl_sw", "yarn", "512")``; the extension is
    ``""`` for a plain run and the last part ``""`` for a name without ``@``."""
    parsed = MetricName(name)
    return parsed.split_name, parsed.kind, parsed.extension, parsed.where
