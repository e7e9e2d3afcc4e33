"""The skeleton every task's job follows: fit, test, finish.

A task's job (``posenc/tasks/<task>_job.py``) builds its data module and
LightningModule, then calls :func:`fit`; it tests the model :func:`fit` names
(``Fitted.best``) its own way, builds its record (:mod:`posenc.results`) and hands it to
:func:`record` (which fills in the fields every run records) and :func:`write` (rank zero
writes ``metrics.json``, the task's TensorBoard entries and the closing summary).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

import pytorch_lightning as pl
from omegaconf import OmegaConf

from posenc import results
from posenc.results import Record
from posenc.schema import Run, untyped
from posenc.training import gate
from posenc.training.callbacks import Throughput, peak_memory_mb
from posenc.training.summary import summary
from posenc.training.trainer import best_checkpoint, build_trainer, run_state, save_last

log = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)


@dataclass
class Fitted:
    """What a fit leaves for the test and the record.

    Attributes:
        trainer: The trainer (its callbacks: throughput, the gate, checkpoints).
        train_time: Seconds of ``trainer.fit``, those of the run's training before it was
            resumed included (0 with ``eval_only``).
        val: The last validation's metrics, read before the test (testing a checkpoint
            restores its callbacks' state).
        best: The checkpoint to test: ``best.ckpt`` (lowest validation loss), or ""
            for the weights in memory (``eval_only``, or a run the learnability gate
            stopped: the weights that met it).
    """

    trainer: pl.Trainer
    train_time: float
    val: dict[str, float]
    best: str


def fit(
    cfg: Run[Any],
    run_dir: Path,
    task: pl.LightningModule,
    throughput: Throughput,
    datamodule: pl.LightningDataModule,
    tokenizer: tuple[str, ...] | None = None,
    tokenizer_payload: dict[str, Any] | None = None,
    callbacks: Sequence[pl.Callback] = (),
) -> Fitted:
    """Build the trainer (:func:`~posenc.training.trainer.build_trainer`: the tokenizer's
    fingerprints and payload go into the checkpoints, ``callbacks`` join posenc's) and
    fit, unless ``eval_only``; ``last.ckpt`` is saved at the end."""
    trainer = build_trainer(cfg, run_dir, throughput, tokenizer, tokenizer_payload, callbacks)
    if not cfg.eval_only:
        trainer.fit(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        save_last(trainer, run_dir)
    train_time = throughput.fit_seconds()  # with the training before a resume
    val = dict(run_state(trainer).val)
    # the best checkpoint by validation loss, or the weights that met the gate
    best = best_checkpoint(trainer) if not (cfg.eval_only or gate.stopped(trainer)) else ""
    return Fitted(trainer, train_time, val, best)


def record(
    cfg: Run[Any],
    task: pl.LightningModule,
    fitted: Fitted,
    throughput: Throughput,
    fields: R,
    decode_time: float | None = None,
    throughput_kind: str | None = None,
) -> R:
    """The run's record: the task's ``fields``, with what every run records filled in: the
    gate's standing, the model's size, the training's steps and time (and the decoding
    time, in seconds), throughput, peak memory and the resolved config."""
    mem, mem_kind = peak_memory_mb(task.device)
    trainer = fitted.trainer
    standing = gate.result(trainer, fitted.val)
    config = cast(dict[str, Any], OmegaConf.to_container(untyped(cfg), resolve=True))
    return replace(
        fields,
        gate=standing.gate,
        learned=standing.learned,
        learned_step=standing.learned_step,
        n_params=cast(int, task.n_params),
        train_steps=trainer.global_step,
        train_time_s=round(fitted.train_time, 2),
        decode_time_s=None if decode_time is None else round(decode_time, 2),
        tokens_per_s=round(throughput.tokens_per_s, 1),
        tokens_per_s_kind=throughput_kind,
        peak_memory_mb=round(mem, 1),
        peak_memory_kind=mem_kind,
        config=config,
    )


def write(
    run_dir: Path,
    trainer: pl.Trainer,
    result: Record,
    files: Callable[[], Mapping[str, Path] | None],
    message: str = "",
) -> dict[str, Any]:
    """On rank zero: ``metrics.json``, then the task's other files and TensorBoard entries
    (``files()``, which returns the files the closing summary should name, by label), a
    log line and the run's closing summary.

    Returns:
        The record as ``metrics.json`` holds it (what :func:`posenc.train.train` returns).
    """
    if trainer.is_global_zero:
        path = run_dir / results.FILE
        results.write(path, result)
        shown = files()
        log.info("%smetrics written to %s", f"{message}; " if message else "", path)
        print(summary(result, run_dir, shown), flush=True)
    return results.to_json(result)
