"""Section ``overhead`` of ``experiments/bench.py``: Lightning Trainer vs a bare loop.

Notation: B batch, T sequence length.

Both sides train an :class:`~posenc.tasks.lm.LMTask` built from the same config
and seed, on the same fixed list of random batches served by the same kind of
``DataLoader``, for the same number of steps, with the optimiser and schedule of
``LMTask.configure_optimizers`` (AdamW, per-step LambdaLR) and gradient-norm
clipping at 1.0. The Lightning side is timed from ``on_train_start`` to
``on_train_end`` by a callback, so Trainer construction and ``fit``'s setup
(device placement, ``configure_optimizers``) are excluded, as is the bare
loop's optimiser construction. What remains on the Lightning side and not on
the bare one is Lightning itself: its loop, hooks, ``self.log`` and closure.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import torch
from bench_common import Goal, Row, interleaved, sync
from bench_train import random_batch
from torch import nn
from torch.utils.data import DataLoader

BASELINE = "bare PyTorch loop"
GOAL = Goal(">=", 0.9)
OPTIM = {
    "lr": 1e-3,
    "betas": [0.9, 0.99],
    "weight_decay": 0.1,
    "warmup_steps": 100,
    "schedule": "cosine",
}


def _bare_fit(task: Any, loader: DataLoader, device: torch.device) -> float:
    """What ``Trainer.fit`` does per step, by hand; returns the loop's seconds."""
    cfg = task.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    sync(device)
    t0 = time.perf_counter()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        opt.zero_grad()
        loss = task.token_nll(batch).mean()
        if not torch.isfinite(loss):  # LMTask.training_step checks this too
            raise FloatingPointError(f"loss {loss.item()}")
        loss.backward()
        nn.utils.clip_grad_norm_(task.parameters(), 1.0)
        opt.step()
        sched.step()
    sync(device)
    return time.perf_counter() - t0


def run(
    *,
    encoder: str,
    model_cfg: dict[str, Any],
    vocab: int,
    batch: int,
    length: int,
    steps: int,
    rounds: int,
    device: torch.device,
) -> dict[str, Any]:
    """Tokens/s of a Lightning fit relative to the bare loop, in interleaved rounds.

    Each round is one fit of ``steps`` steps per side; one warm-up round is added.

    Returns:
        ``{"config", "baseline", "rows"}``.
    """
    import pytorch_lightning as pl

    from posenc.encoders import get
    from posenc.tasks.lm import LMTask

    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # "GPU available: ..." banners

    cls = get(encoder)
    kwargs = {
        "vocab_size": vocab,
        "encoder": {"_target_": f"{cls.__module__}.{cls.__qualname__}", "_partial_": True},
        "model": model_cfg,
        "optim": OPTIM,
        "max_steps": steps,
        "seq_len": length,
    }
    tasks = {}
    for side in ("lightning", "bare"):
        torch.manual_seed(0)
        tasks[side] = LMTask(**kwargs).to(device)
    batches = []
    for i in range(steps):
        ids, tgt = random_batch(batch, length, vocab, torch.device("cpu"), seed=i)
        batches.append({"input": ids, "target": tgt})
    # batch_size=None: the loader hands out the prepared dicts one by one, uncollated.
    loader = DataLoader(batches, batch_size=None, shuffle=False)

    class Clock(pl.Callback):
        """Brackets the training loop proper, excluding the Trainer's setup."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            sync(device)
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            sync(device)
            self.seconds = time.perf_counter() - self.t0

    def lightning_fit() -> float:
        clock = Clock()
        trainer = pl.Trainer(
            accelerator=device.type,
            devices=1,
            max_steps=steps,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            gradient_clip_val=1.0,
            callbacks=[clock],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # few-workers and no-validation notices
            trainer.fit(tasks["lightning"], train_dataloaders=loader)
        if trainer.global_step != steps:
            raise RuntimeError(f"Lightning ran {trainer.global_step} steps, not {steps}")
        return clock.seconds / steps

    def bare_fit() -> float:
        return _bare_fit(tasks["bare"], loader, device) / steps

    stats = interleaved(
        {BASELINE: bare_fit, "Lightning Trainer.fit": lightning_fit},
        baseline=BASELINE,
        rounds=rounds,
    )
    tokens = batch * length
    rows = []
    for name, s in stats.items():
        s["tokens_per_s"] = [tokens / t for t in s["times_s"]]
        goal = GOAL if name != BASELINE else None
        note = f"{tokens / s['median_s']:,.0f} tok/s"
        rows.append(Row(name, s["median_s"], s["ratio"], goal, note=note, raw=s))
    return {
        "config": {
            "encoder": encoder,
            "model": model_cfg,
            "shape_BT": [batch, length],
            "steps_per_fit": steps,
            "timed": "Lightning: on_train_start..on_train_end; bare: the step loop",
            "same_work": "LMTask.token_nll, AdamW+LambdaLR from configure_optimizers, "
            "clip_grad_norm 1.0, same batches and seed",
        },
        "baseline": BASELINE,
        "unit": "seconds per step",
        "rows": rows,
    }
