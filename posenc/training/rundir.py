"""A run's directory: the guard against writing over another run, the job record, the
checkpoint a resumed run continues from, atomic result files, and disk space held back so
that a sweep job's failure can be recorded on a full disk."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posenc.errors import RunDirError
from posenc.files import write_text_atomic


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write JSON as :func:`write_text_atomic` does."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


#: What a failed write is called in ``error.json`` and the sweep's summary, by errno.
WRITE_FAILURES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EIO: "input/output error",
}


def write_failure(err: BaseException) -> str | None:
    """``"no space left on device: <file>"`` when ``err``, or an error it came from, is a
    write that failed for a reason in :data:`WRITE_FAILURES`; None otherwise."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in WRITE_FAILURES:
            return WRITE_FAILURES[seen.errno] + (f": {seen.filename}" if seen.filename else "")
        seen = seen.__cause__ or seen.__context__
    return None


#: The file in a sweep job's directory that holds disk space back for its ``error.json``.
RESERVE = ".error.json.reserved"
#: How much: an error record with a long traceback fits (:func:`write_into_reserve`).
RESERVE_BYTES = 64 * 1024


@contextlib.contextmanager
def space_for_error_record(run_dir: Path) -> Iterator[None]:
    """Hold :data:`RESERVE_BYTES` of disk in ``run_dir`` while a sweep job runs, so that
    its failure can still be recorded (:func:`write_into_reserve`) when the disk fills up
    under it; the space is given back on leaving. A disk already too full to hold it back
    holds nothing back."""
    path = run_dir / RESERVE
    try:
        _allocate(path, RESERVE_BYTES)
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    try:
        yield
    finally:
        release_error_space(run_dir)


def release_error_space(run_dir: Path) -> None:
    """Give back the space :func:`space_for_error_record` holds in ``run_dir`` (none
    held: nothing to do)."""
    with contextlib.suppress(OSError):
        (run_dir / RESERVE).unlink(missing_ok=True)


def _allocate(path: Path, size: int) -> None:
    """A file of ``size`` bytes whose blocks the file system has given it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:  # a file system without fallocate: write the bytes
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            _write_all(fd, bytes(size))
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_into_reserve(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` in the space :func:`space_for_error_record` held
    back beside it: the bytes go into blocks the file already has, the file is cut to
    their length and renamed to ``path``, so nothing needs a new block of a full disk.
    A traceback too long for the space keeps its end (where the error is).

    Raises:
        OSError: No space is held back here, or writing into it failed.
    """
    text = json.dumps(data, indent=2, default=str).encode()
    if len(text) > RESERVE_BYTES and "traceback" in data:
        keep = max(0, len(str(data["traceback"])) - (len(text) - RESERVE_BYTES) - 64)
        data = {**data, "traceback": "...\n" + str(data["traceback"])[-keep:]}
        text = json.dumps(data, indent=2, default=str).encode()
    reserve = path.parent / RESERVE
    fd = os.open(reserve, os.O_WRONLY)
    try:
        _write_all(fd, text)
        os.ftruncate(fd, len(text))
    finally:
        os.close(fd)
    os.replace(reserve, path)


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
#: The job record :func:`record_job` writes in ``.hydra``.
RECORD_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}


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
        write_text_atomic(record / name, OmegaConf.to_yaml(node))
    root = logging.getLogger()
    path = str(run_dir / f"{hc.job.name}.log")
    if not any(getattr(h, "baseFilename", None) == path for h in root.handlers):
        handler = logging.FileHandler(path)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
        )
        root.addHandler(handler)


def forget_refused_run(run_dir: Path) -> None:
    """Remove what :func:`record_job` wrote for a run refused before it did anything else
    (a checkpoint of another model, data that cannot be had): the job record and the log,
    then the directory, when nothing else is in it. A directory holding anything more
    (TensorBoard logs, a checkpoint, another run's files) is left as it is.
    """
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - {".hydra", "run.log"}:
        return
    record = run_dir / ".hydra"
    if record.is_dir() and {p.name for p in record.iterdir()} - RECORD_FILES:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        if Path(handler.baseFilename).parent == run_dir.resolve():
            root.removeHandler(handler)
            handler.close()
    with contextlib.suppress(OSError):
        for name in RECORD_FILES:
            (record / name).unlink(missing_ok=True)
        if record.is_dir():
            record.rmdir()
        (run_dir / "run.log").unlink(missing_ok=True)
        run_dir.rmdir()


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
    message names the checkpoint to give; for a folder (a run's, or its
    ``checkpoints``), the checkpoints in it.

    Args:
        path: The checkpoint asked for.
        key: The option that gave it (``ckpt_path``), or "" for a positional argument.
    """
    given = f"{key}={path}" if key else str(path)
    if path.is_dir():  # a run's folder, or its checkpoints folder
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        what = "is a folder, not a checkpoint file"
    else:
        folder, what = path.parent, "no such file"
    found = checkpoints_in(folder)
    if not found:
        return f"{given}: {what}"
    names = ", ".join(p.name for p in found)
    option = f"{key}=" if key else ""
    return f"{given}: {what}; {folder} holds {names}: give {option}{found[0]}"
