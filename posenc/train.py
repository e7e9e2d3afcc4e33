"""``train(cfg)``: validate the config, prepare the run directory, seed, and run
the task's job (fit, then evaluate beyond the training length)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from posenc import schema, tuned
from posenc.config import validate
from posenc.errors import CheckpointError
from posenc.schema import Run, typed
from posenc.tasks import algo_job, lm_job, mt_job
from posenc.training import checkpoints
from posenc.training.rundir import guard_run_dir, record_job, resume_checkpoint
from posenc.training.trainer import command_line_keys, quiet_third_party

log = logging.getLogger(__name__)

_ABSENT = object()

T = TypeVar("T", bound=schema.Group)


@dataclass(frozen=True)
class Job(Generic[T]):
    """One task's job, as ``train`` runs it.

    Attributes:
        name: The task's name, ``task.name`` (``task=<name>`` on the command line).
        task: The typed ``task`` group the job reads (:data:`posenc.schema.TASKS`).
        run: Fits and evaluates: ``run(cfg, run_dir)`` returns the contents of
            ``metrics.json``.
    """

    name: str
    task: type[T]
    run: Callable[[Run[T], Path], dict[str, Any]]


#: task name -> its job.
JOBS: dict[str, Job[Any]] = {
    job.name: job
    for job in (
        Job("lm", schema.LMTask, lm_job.run),
        Job("mt", schema.MTTask, mt_job.run),
        Job("algo", schema.AlgoTask, algo_job.run),
    )
}


def checkpoint_model(cfg: DictConfig, saved: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The model sizes and encoder options an ``eval_only`` run takes from its checkpoint's
    config: every ``model.*`` and ``encoder.*`` value the command line did not set, and
    each such key added since the checkpoint was written at the value its run had
    (:data:`~posenc.training.checkpoints.ADDED_LATER`). The encoder itself, its
    ``_target_``, stays the one chosen (another is refused later), and speed-only settings
    such as ``model.compile`` stay this run's.

    Args:
        cfg: This run's config.
        saved: The checkpoint's config.
        given: The keys the command line set (:func:`command_line_keys`).

    Returns:
        ``{key: checkpoint's value}`` for the keys to take.

    Raises:
        CheckpointError: The command line set a model key to another value than the
            checkpoint's (both values named, on one line).
    """
    if (saved.get("task") or {}).get("name", cfg.task.name) != cfg.task.name:
        return {}  # a checkpoint of another task is refused later, in one line
    flat = {
        k: v
        for k, v in checkpoints.flat(saved).items()
        if k.startswith(("model.", "encoder."))
        and k != "encoder._target_"
        and not k.startswith(checkpoints.RUNTIME_ONLY)
    }
    # Keys added since the checkpoint was written: the value its run had, not today's default.
    flat |= {
        k: v
        for k, v in checkpoints.ADDED_LATER.items()
        if saved
        and k.startswith(("model.", "encoder."))
        and k not in flat
        and OmegaConf.select(cfg, k, default=_ABSENT) is not _ABSENT
    }
    if flat and saved.get("encoder", {}).get("_target_") != cfg.encoder.get("_target_"):
        flat = {k: v for k, v in flat.items() if k.startswith("model.")}  # refused later
    conflicts = [
        f"{k}={OmegaConf.select(cfg, k)} was given but the checkpoint's model has {k}={v}"
        for k, v in flat.items()
        if k in given and OmegaConf.select(cfg, k) != v
    ]
    if conflicts:
        raise CheckpointError(
            f"eval_only with {cfg.ckpt_path}: {'; '.join(conflicts)}. Leave the model's "
            f"sizes and encoder options out (eval_only takes them from the checkpoint)"
        )
    return {k: v for k, v in flat.items() if k not in given and OmegaConf.select(cfg, k) != v}


def take_checkpoint_model(cfg: DictConfig, given: set[str] | None) -> None:
    """``eval_only``: the checkpoint's model sizes and encoder options
    (:func:`checkpoint_model`) replace the config's defaults, before the config is checked,
    so evaluating a small model needs no sizes retyped; so does its ``label`` where this
    run sets none. ``given``: the keys the command line set (:func:`command_line_keys`;
    None when unknown, and then nothing is taken)."""
    path = cfg.get("ckpt_path")
    if not (cfg.get("eval_only") is True and path and given is not None and Path(path).is_file()):
        return
    saved = (checkpoints.load(path).get("posenc") or {}).get("config") or {}
    taken = checkpoint_model(cfg, saved, given)
    if saved.get("label") and cfg.get("label") is None:
        taken["label"] = saved["label"]  # rope_qknorm's weights stay rope_qknorm's row
    for key, value in taken.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    if taken:
        log.info(
            "eval_only: the model as %s was trained: %s",
            path,
            " ".join(f"{k}={v}" for k, v in taken.items()),
        )


def check_checkpoint(cfg: DictConfig) -> None:
    """Before any data is loaded: ``cfg.ckpt_path`` is a whole checkpoint of a model that
    fits the config (:func:`posenc.training.checkpoints.check_config`). Under ``eval_only``,
    training settings that differ from the checkpoint's have no effect: they are reported,
    and the config (hence ``metrics.json``) takes the checkpoint's values.
    """
    path = str(cfg.ckpt_path)
    ckpt = checkpoints.load(path)
    ignored = checkpoints.check_config(path, ckpt, cfg, resume=not cfg.eval_only)
    # A tuned-lr record the checkpoint lacks (``+tuned`` given to the evaluation) is kept
    # when the checkpoint was trained at that rate: see _tuned_record below.
    shown = {
        k: v
        for k, v in ignored.items()
        if not (k.startswith("tuned.") and v[0] == checkpoints.UNSET)
    }
    if shown:
        log.warning(
            "eval_only: these settings differ from the checkpoint's and have no effect on "
            "an evaluation; metrics.json records the checkpoint's values:\n  %s",
            "\n  ".join(f"{k}: checkpoint {a!r}, config {b!r}" for k, (a, b) in shown.items()),
        )
    for key, (saved, _) in ignored.items():
        if saved != checkpoints.UNSET:
            OmegaConf.update(cfg, key, saved, force_add=True)
    if cfg.eval_only:
        _tuned_record(cfg, path)


def _tuned_record(cfg: DictConfig, path: str) -> None:
    """An evaluation's ``tuned`` record must be true of the model evaluated: a model
    trained at its scheme's tuned rate (by ``+tuned`` or not) counts as tuned, so a
    tuning sweep's model at the chosen rate is evaluated into the tuned-lr table without
    training it again; a model trained at another rate keeps no record (the report would
    put it in a table of rates it was not trained at)."""
    record = cfg.get("tuned")
    if not OmegaConf.is_dict(record):
        return
    lr = cfg.task.optim.lr
    if isinstance(record.get("lr"), float | int) and math.isclose(lr, record.lr, rel_tol=1e-9):
        log.info(
            "eval_only: %s was trained at %s's tuned rate %g: counted as tuned",
            path,
            record.get("encoder"),
            lr,
        )
        return
    log.warning(
        "eval_only: %s was trained at task.optim.lr=%g, not the tuned rate %s of %s: "
        "its metrics are not counted as tuned (tuned: null)",
        path,
        lr,
        record.get("lr"),
        record.get("file"),
    )
    cfg.tuned = None


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one job (train, then evaluate) and return the contents of ``metrics.json``.

    Args:
        cfg: The composed Hydra config (``conf/config.yaml``).

    Returns:
        The metrics dictionary written to ``<run dir>/metrics.json``.
    """
    quiet_third_party()
    given = command_line_keys(cfg)
    # +tuned=<report dir>: this encoder's tuned lr, before the checks
    tuned.apply(cfg, given or ())
    take_checkpoint_model(cfg, given)
    validate(cfg)
    run_dir = Path(cfg.paths.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = resume_checkpoint(cfg, run_dir)
    own = ckpt is not None and run_dir.resolve() in Path(ckpt).resolve().parents
    guard_run_dir(run_dir, resuming=own, resume_requested=bool(cfg.get("resume")))
    record_job(cfg, run_dir)
    if ckpt and not cfg.eval_only:
        cfg.ckpt_path = ckpt  # the job continues fitting from here
        log.info("continuing from %s", ckpt)
    if cfg.ckpt_path:
        check_checkpoint(cfg)
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    pl.seed_everything(cfg.seed, workers=True)
    if cfg.task.name not in JOBS:
        raise ValueError(f"task.name={cfg.task.name!r}: allowed {', '.join(JOBS)}")
    return JOBS[cfg.task.name].run(typed(cfg), run_dir)
