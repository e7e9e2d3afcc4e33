"""Pieces every task's job shares: the Trainer with posenc's logger and
callbacks, atomic result files, the guard against overwriting a run, HParams."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from pytorch_lightning.loggers import TensorBoardLogger

from posenc.tasks.callbacks import Throughput


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file and ``os.replace``: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def guard_run_dir(run_dir: Path, resuming: bool) -> None:
    """Refuse to write over another run's results."""
    if resuming:
        return
    taken = [p.name for p in (run_dir / "metrics.json", run_dir / "checkpoints") if p.exists()]
    if taken:
        raise FileExistsError(
            f"run directory {run_dir} already holds {', '.join(taken)} from another run; "
            f"posenc never overwrites results. Pick another hydra.run.dir, or pass "
            f"ckpt_path=... to resume that run."
        )


def build_trainer(cfg: DictConfig, run_dir: Path, throughput: Throughput) -> pl.Trainer:
    """Lightning Trainer from ``cfg.trainer`` plus posenc's logger and callbacks."""
    logger = TensorBoardLogger(
        save_dir=str(run_dir), name="tb", version="", default_hp_metric=False
    )
    callbacks = [
        ModelCheckpoint(
            dirpath=run_dir / "checkpoints",
            filename="best",
            monitor="val/loss",
            save_last=True,
            save_top_k=1,
        ),
        LearningRateMonitor(logging_interval="step"),
        throughput,
    ]
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(RichProgressBar())
    return instantiate(
        cfg.trainer, logger=logger, callbacks=callbacks, default_root_dir=str(run_dir)
    )


def group_choice(cfg: DictConfig, group: str) -> str:
    """The Hydra group choice (``rope``); outside a Hydra run (a config composed by
    hand), the registered name of the configured class."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices[group]
    cls = get_class(cfg[group]._target_)
    return getattr(cls, "name", cls.__name__)


def log_hparams(trainer: pl.Trainer, hparams: dict[str, Any], metrics: dict[str, float]) -> None:
    """HParams linked to the final metrics, so runs compare in TensorBoard's HParams tab."""
    if isinstance(trainer.logger, TensorBoardLogger):
        finite = {k: v for k, v in metrics.items() if math.isfinite(v)}
        trainer.logger.log_hyperparams(hparams, finite)
        trainer.logger.finalize("success")
