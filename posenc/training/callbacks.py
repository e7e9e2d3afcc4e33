"""Callbacks every task uses: training throughput, peak memory, the progress display (a
bar counting steps on a terminal, plain lines otherwise)."""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import RichProgressBar

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
    """Logs ``train/tokens_per_s`` (all ranks together) and keeps the run's average, and
    the training time before this process: a checkpoint holds both, so a run resumed from
    it (``resume=true``, ``ckpt_path``) reports the time and throughput of all its
    training, not of its last part alone. Testing a checkpoint leaves them as they are.

    Args:
        key: Batch entry whose ``numel()`` counts the tokens of a step.
    """

    #: The checkpoint's entry.
    STATE = "posenc_throughput"

    def __init__(self, key: str = "input") -> None:
        self.key = key
        self.tokens = 0
        self.seconds = 0.0
        #: Seconds of ``fit`` before this process's (read from the checkpoint resumed).
        self.fit_before = 0.0
        self._fit_t0: float | None = None
        self._t0: float | None = None
        self._window: list[tuple[int, float]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # fit's first hook: the clock of the run's training time
            self._fit_t0 = time.perf_counter()

    def fit_seconds(self) -> float:
        """Seconds of ``fit`` so far, those before a resume included (0 without a fit):
        the run's ``train_time_s``."""
        now = 0.0 if self._fit_t0 is None else time.perf_counter() - self._fit_t0
        return self.fit_before + now

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = {"tokens": self.tokens, "seconds": self.seconds, "fit": self.fit_seconds()}
        checkpoint[self.STATE] = state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get(self.STATE)  # older checkpoints hold none
        if state is None or trainer.state.fn != "fit":
            return
        self.tokens, self.seconds, self.fit_before = state["tokens"], state["seconds"], state["fit"]

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


def eval_label(module: pl.LightningModule, index: int) -> str:
    """What evaluation loader ``index`` evaluates, as the task names it (its
    ``eval_labels``: ``test ppl@512 nonoverlap``), or ``Testing`` for a task that names none."""
    labels = getattr(module, "eval_labels", None) or []
    return str(labels[index]) if index < len(labels) else "Testing"


class StepProgressBar(RichProgressBar):
    """Lightning's rich bar counting optimizer steps to ``trainer.max_steps``, and each
    evaluation bar named by what it evaluates.

    posenc trains for a number of steps from a loader with no end, so Lightning's own bar
    showed an epoch ``0/-2`` and a count of batches up to the validation interval; its
    evaluation bars all read ``Testing``.
    """

    @property
    def total_train_batches(self) -> int | float:
        """``trainer.max_steps`` (Lightning's count of one epoch's batches without one)."""
        steps = self.trainer.max_steps
        return steps if steps > 0 else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return f"{'train step':{len(self.validation_description)}}"

    @property
    def test_description(self) -> str:
        return eval_label(self.trainer.lightning_module, self._current_eval_dataloader_idx or 0)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        # Lightning's own hook counts batches; this one the steps (a resumed run starts
        # where it stopped), and draws once a step.
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # a run resumed mid-epoch
        self._update_metrics(trainer, pl_module)
        self._update(self.train_progress_bar_id, trainer.global_step)


class PlainProgress(pl.Callback):
    """One plain log line every ``every`` training steps (step, loss, tokens/s, elapsed,
    ETA), and one as each evaluation loader starts, where no progress bar is drawn: output
    that is not a terminal (SLURM logs, ``nohup``), or ``trainer.enable_progress_bar=false``.

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

    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if batch_idx or not trainer.is_global_zero:
            return
        loaders = trainer.test_dataloaders
        count = len(loaders) if isinstance(loaders, list | tuple) else 1
        log.info(
            "evaluating %s (%d/%d)",
            eval_label(pl_module, dataloader_idx),
            dataloader_idx + 1,
            count,
        )
