"""Optimiser and learning-rate schedules shared by the tasks."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from posenc.choices import SCHEDULES
from posenc.errors import TrainingDiverged


def check_finite(loss: torch.Tensor, step: int) -> None:
    """Stop training on a NaN or infinite loss, saying what to do (every task's
    ``training_step``; the last good checkpoint stays as it was)."""
    if not torch.isfinite(loss):
        raise TrainingDiverged(
            f"training loss is {loss.item()} at step {step}; the last good checkpoint is "
            f"kept. Lower task.optim.lr or check the data."
        )


def warmup_cosine(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to ``min_ratio`` at ``total``.

    ``warmup=0`` starts at the peak (no warmup).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_inverse_sqrt(step: int, *, warmup: int) -> float:
    """LR multiplier of Vaswani et al. 2017 (eq. 3), normalised to peak at 1 after warmup.

    ``warmup`` 0 and 1 are the same: the peak at the first step, then ``1 / sqrt(step)``.
    """
    warmup = max(1, warmup)  # the formula divides by it
    step = step + 1
    return min(step / warmup, math.sqrt(warmup / step))


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; biases, norms and 1-D positional vectors are not decayed."""
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def configure_adamw(module: pl.LightningModule, optim: dict[str, Any], max_steps: int) -> Any:
    """AdamW with a per-step schedule (``optim['schedule']``: cosine or inverse_sqrt)."""
    opt = torch.optim.AdamW(
        adamw_groups(module, optim["weight_decay"]), lr=optim["lr"], betas=tuple(optim["betas"])
    )
    schedule = optim.get("schedule", "cosine")
    warmup = int(optim["warmup_steps"])
    if warmup < 0:  # config validation refuses it; a direct caller gets the same rule
        raise ValueError(f"optim.warmup_steps={warmup}: must be an integer >= 0 (0: no warmup)")
    if schedule == "cosine":
        ratio = float(optim.get("min_lr_ratio", 0.1))
        fn = lambda s: warmup_cosine(s, warmup=warmup, total=max_steps, min_ratio=ratio)  # noqa: E731
    elif schedule == "inverse_sqrt":
        fn = lambda s: warmup_inverse_sqrt(s, warmup=warmup)  # noqa: E731
    else:
        raise ValueError(f"optim.schedule={schedule!r}: allowed {', '.join(SCHEDULES)}")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
