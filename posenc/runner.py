"""Pieces every task's job shares: the Trainer with posenc's logger and
callbacks, atomic result files, the guard against overwriting a run, HParams."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar
from pytorch_lightning.loggers import TensorBoardLogger

from posenc.tasks.callbacks import Throughput

log = logging.getLogger(__name__)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file and ``os.replace``: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint to continue training from, if any.

    ``ckpt_path=...`` names one explicitly. ``resume=true`` continues from
    ``<run dir>/checkpoints/last.ckpt`` when it exists and starts afresh otherwise, so the
    same command (with a fixed ``hydra.run.dir``) works before and after a crash or kill.
    """
    if cfg.eval_only:
        return None
    if cfg.ckpt_path:
        return str(cfg.ckpt_path)
    last = run_dir / "checkpoints" / "last.ckpt"
    return str(last) if cfg.get("resume", False) and last.exists() else None


def guard_run_dir(run_dir: Path, resuming: bool) -> None:
    """Refuse to write over another run's results.

    Args:
        run_dir: This run's directory.
        resuming: The run continues from a checkpoint of this directory.

    Raises:
        FileExistsError: The directory holds another run's results.
    """
    if (run_dir / "metrics.json").exists():
        raise FileExistsError(
            f"run directory {run_dir} already holds a finished run's metrics.json; posenc "
            f"never overwrites results. Pick another hydra.run.dir."
        )
    if not resuming and (run_dir / "checkpoints").exists():
        raise FileExistsError(
            f"run directory {run_dir} already holds checkpoints from another run; posenc "
            f"never overwrites results. Pick another hydra.run.dir, or add resume=true to "
            f"continue that run."
        )


class RngState(pl.Callback):
    """Keeps the torch RNG state in checkpoints, so a resumed run draws the same
    dropout masks as an uninterrupted one."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["posenc_rng"] = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            checkpoint["posenc_rng"]["cuda"] = torch.cuda.get_rng_state_all()

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        state = checkpoint.get("posenc_rng")
        if state is None:
            return
        torch.set_rng_state(state["cpu"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def build_trainer(cfg: DictConfig, run_dir: Path, throughput: Throughput) -> pl.Trainer:
    """Lightning Trainer from ``cfg.trainer`` plus posenc's logger and callbacks.

    Checkpoints (written atomically by Lightning): ``best.ckpt`` by the task's
    ``monitor`` metric at each validation, and ``last.ckpt`` every
    ``checkpoint_every_n_steps`` steps, for resuming.
    """
    logger = TensorBoardLogger(
        save_dir=str(run_dir), name="tb", version="", default_hp_metric=False
    )
    ckpt_dir = run_dir / "checkpoints"
    callbacks = [
        ModelCheckpoint(
            dirpath=ckpt_dir,
            filename="best",
            monitor=cfg.task.get("monitor", "val/loss"),
            mode=cfg.task.get("monitor_mode", "min"),
            save_top_k=1,
        ),
        ModelCheckpoint(
            dirpath=ckpt_dir,
            save_last=True,
            save_top_k=0,
            every_n_train_steps=cfg.checkpoint_every_n_steps,
        ),
        LearningRateMonitor(logging_interval="step"),
        RngState(),
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


def load_for_eval(
    task_cls: type[pl.LightningModule], cfg: DictConfig, vocab_size: int
) -> pl.LightningModule:
    """The task stored in ``cfg.ckpt_path`` (for ``eval_only``), checked against the data.

    Raises:
        ValueError: The checkpoint's vocabulary differs from the configured tokenizer's.
    """
    task = task_cls.load_from_checkpoint(cfg.ckpt_path, map_location="cpu")
    if task.hparams.vocab_size != vocab_size:
        raise ValueError(
            f"checkpoint {cfg.ckpt_path} has vocab_size={task.hparams.vocab_size} but the "
            f"configured data/tokenizer give {vocab_size}; use the data and tokenizer "
            f"settings it was trained with"
        )
    return task


def init_from_checkpoint(task: pl.LightningModule, path: str) -> None:
    """Initialise ``task.model`` with the model weights (only) of checkpoint ``path``.

    This is ``init_from=...``: a new run (fresh optimiser, schedule and step counter) that
    starts from another run's weights, e.g. a short fine-tune at a longer context. The
    checkpoint's optimiser state, step and settings are not used.

    Raises:
        ValueError: The checkpoint's model does not match this run's (sizes, vocabulary,
            or an encoder with other parameters); loading is strict.
    """
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()
             if k.startswith("model.")}
    try:
        task.model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(
            f"init_from={path}: the checkpoint's model does not match this run's; use the "
            f"model sizes, data/tokenizer and encoder it was trained with.\n{err}"
        ) from err
    theirs = ckpt.get("hyper_parameters", {}).get("encoder", {}).get("_target_")
    ours = task.hparams.get("encoder", {}).get("_target_")
    if theirs != ours:
        log.warning("init_from=%s: weights of a %s model initialise a %s model", path,
                    theirs, ours)
    log.info("model weights initialised from %s (step %s of that run)", path,
             ckpt.get("global_step"))
