"""Callbacks every task uses: training throughput, peak memory, plain progress lines."""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch

from posenc.progress import clock

log = logging.getLogger(__name__)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory in MiB and what it measures (CUDA allocator, or process RSS on CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 2**20 if sys.platform == "darwin" else 2**10  # bytes on macOS, KiB on Linux
    return rss / scale, "process_peak_rss"


class Throughput(pl.Callback):
    """Logs ``train/tokens_per_s`` (all ranks together) and keeps the run's average.

    Args:
        key: Batch entry whose ``numel()`` counts the tokens of a step.
    """

    def __init__(self, key: str = "input") -> None:
        self.key = key
        self.tokens = 0
        self.seconds = 0.0
        self._t0: float | None = None
        self._window: list[tuple[int, float]] = []

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._t0 is None:
            return
        dt = time.perf_counter() - self._t0
        n = int(batch[self.key].numel()) * trainer.world_size
        self.tokens += n
        self.seconds += dt
        self._window.append((n, dt))
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # not declared on Trainer
        if len(self._window) >= every:
            tok, sec = map(sum, zip(*self._window, strict=True))
            pl_module.log("train/tokens_per_s", tok / max(sec, 1e-9))
            self._window.clear()

    @property
    def tokens_per_s(self) -> float:
        """Average over all training steps so far (0 before training)."""
        return self.tokens / self.seconds if self.seconds else 0.0


class PlainProgress(pl.Callback):
    """One plain log line every ``every`` training steps (step, loss, tokens/s, ETA), for
    output that is not a terminal (SLURM logs, ``nohup``), where a progress bar shows
    nothing until the end.

    Args:
        throughput: The run's :class:`Throughput` (its running tokens/s).
        every: Steps between lines; ``None``: a twentieth of ``trainer.max_steps``.
    """

    def __init__(self, throughput: Throughput, every: int | None = None) -> None:
        self.throughput = throughput
        self.every = every
        self._start: float | None = None
        self._first_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._first_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step, total = trainer.global_step, trainer.max_steps
        every = self.every or max(1, total // 20)
        if step % every and step != total or not trainer.is_global_zero:
            return
        loss = trainer.callback_metrics.get("train/loss")
        elapsed = time.perf_counter() - (self._start or time.perf_counter())
        done = max(step - self._first_step, 1)
        eta = elapsed / done * max(total - step, 0)
        log.info(
            "step %d/%d  train/loss %s  %.0f tokens/s  elapsed %s  ETA %s",
            step,
            total,
            "?" if loss is None else f"{float(loss):.4f}",
            self.throughput.tokens_per_s,
            clock(elapsed),
            clock(eta),
        )
