"""A run's directory: the guard against writing over another run, the job record, the
checkpoint a resumed run continues from, atomic result files."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posenc.errors import RunDirError


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file and ``os.replace``: never a half-written file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    """The checkpoint to continue training from, if any.

    ``ckpt_path=...`` names one explicitly. ``resume=true`` continues from
    ``<run dir>/checkpoints/last.ckpt`` (or from the newer checkpoint Lightning saved
    before a SLURM requeue) when it exists and starts afresh otherwise, so the same command
    (with a fixed ``hydra.run.dir``) works before and after a crash, kill or requeue.
    """
    if cfg.eval_only:
        return None
    if cfg.ckpt_path:
        return str(cfg.ckpt_path)
    if not cfg.get("resume", False):
        return None
    # last.ckpt, or the checkpoint Lightning saved before a SLURM requeue (hpc_ckpt_N),
    # whichever is newer.
    found = [
        p
        for p in (run_dir / "checkpoints" / "last.ckpt", *run_dir.glob("hpc_ckpt_*.ckpt"))
        if p.is_file()
    ]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


#: What a run writes into its directory before its first checkpoint.
RUN_FILES = (".hydra", "run.log", "tb", "error.json")


def guard_run_dir(run_dir: Path, resuming: bool, resume_requested: bool = False) -> None:
    """Refuse to write over another run's results: a finished run's ``metrics.json``,
    checkpoints (unless this run continues from them), and any other run's files
    (:data:`RUN_FILES`) unless ``resume=true`` says the directory is this run's own.
    Only the first process of a multi-process run checks: the others start after it.

    Args:
        run_dir: This run's directory.
        resuming: The run continues from a checkpoint of this directory.
        resume_requested: ``resume=true`` was given (the directory may hold this run's
            files from before a crash).

    Raises:
        RunDirError: The directory holds another run's results.
    """
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) != 0:
        return
    if (run_dir / "metrics.json").exists():
        raise RunDirError(
            f"run directory {run_dir} already holds a finished run's metrics.json; posenc "
            f"never overwrites results. Pick another hydra.run.dir."
        )
    if not resuming and (run_dir / "checkpoints").exists():
        raise RunDirError(
            f"run directory {run_dir} already holds checkpoints from another run; posenc "
            f"never overwrites results. Pick another hydra.run.dir, or add resume=true to "
            f"continue that run."
        )
    found = sorted(name for name in RUN_FILES if (run_dir / name).exists())
    if found and not (resuming or resume_requested):
        raise RunDirError(
            f"run directory {run_dir} already holds another run's files ({', '.join(found)})"
            f"; posenc never overwrites results. Pick another hydra.run.dir, or add "
            f"resume=true to continue that run."
        )


def record_job(cfg: DictConfig, run_dir: Path) -> None:
    """Hydra's job record (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``) and
    the log file ``run.log``, written once :func:`guard_run_dir` has let this run use
    ``run_dir`` (``conf/config.yaml`` turns Hydra's own early writes off), so a refused
    run leaves another run's files as they were. Outside a Hydra run: nothing.
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    record = run_dir / ".hydra"
    record.mkdir(parents=True, exist_ok=True)
    files = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hc}),
        "overrides.yaml": hc.overrides.task,
    }
    for name, node in files.items():
        tmp = record / f".{name}.tmp{os.getpid()}"
        tmp.write_text(OmegaConf.to_yaml(node), encoding="utf-8")
        os.replace(tmp, record / name)
    root = logging.getLogger()
    path = str(run_dir / f"{hc.job.name}.log")
    if not any(getattr(h, "baseFilename", None) == path for h in root.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        )
        root.addHandler(handler)


def checkpoints_in(folder: Path) -> list[Path]:
    """The checkpoints (``*.ckpt``) in ``folder``: ``best.ckpt`` and ``last.ckpt`` first,
    then any others by name (empty when there is no such folder)."""
    if not folder.is_dir():
        return []
    order = {"best.ckpt": 0, "last.ckpt": 1}
    found = [p for p in folder.glob("*.ckpt") if p.is_file()]
    return sorted(found, key=lambda p: (order.get(p.name, 2), p.name))


def missing_checkpoint(path: Path, key: str = "") -> str:
    """``[<key>=]<path>: no such file``, and what its folder holds instead (a run shorter
    than its validation interval has a ``last.ckpt`` but no ``best.ckpt``), so the
    message names the checkpoint to give.

    Args:
        path: The checkpoint asked for.
        key: The option that gave it (``ckpt_path``), or "" for a positional argument.
    """
    given = f"{key}={path}" if key else str(path)
    found = checkpoints_in(path.parent)
    if not found:
        return f"{given}: no such file"
    names = ", ".join(p.name for p in found)
    return (
        f"{given}: no such file; {path.parent} holds {names}: give "
        f"{f'{key}=' if key else ''}{found[0]}"
    )
