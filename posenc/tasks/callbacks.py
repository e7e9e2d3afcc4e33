"""Callbacks every task uses: training throughput and peak memory."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch


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
        if len(self._window) >= trainer.log_every_n_steps:
            tok, sec = map(sum, zip(*self._window, strict=True))
            pl_module.log("train/tokens_per_s", tok / max(sec, 1e-9))
            self._window.clear()

    @property
    def tokens_per_s(self) -> float:
        """Average over all training steps so far (0 before training)."""
        return self.tokens / self.seconds if self.seconds else 0.0
