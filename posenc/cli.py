"""What ``run.py`` does with a composed config: one job, or one job of a sweep.

In a multirun (``-m``) a failing job writes ``<run dir>/error.json`` and the sweep goes
on with the next job; a single run raises as usual (non-zero exit).
"""

import contextlib
import difflib
import logging
import multiprocessing
import os
import secrets
import signal
import sys
import traceback
from pathlib import Path
from typing import cast

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, ListConfig, OmegaConf
from pytorch_lightning.accelerators import CUDAAccelerator
from pytorch_lightning.utilities.exceptions import SIGTERMException

from posenc import stop
from posenc.errors import RunDirError, UserError
from posenc.runner import write_json_atomic
from posenc.train import train

log = logging.getLogger("posenc.run")


#: This process's run-directory suffix: runs started in the same second (a shell loop, a
#: scheduler array) get directories of their own.
RUN_ID = f"{os.getpid() % 0x10000:04x}{secrets.token_hex(2)}"


def register_resolvers() -> None:
    """``${posenc_uid:}`` and ``${posenc_preset:...}`` in ``conf/config.yaml``'s run and
    sweep directories."""
    if not OmegaConf.has_resolver("posenc_uid"):
        OmegaConf.register_new_resolver("posenc_uid", lambda: RUN_ID, use_cache=True)
    if not OmegaConf.has_resolver("posenc_preset"):
        # A preset's name and "_" (experiment=baby_gpt: baby_gpt_2026-...); "" for none.
        OmegaConf.register_new_resolver(
            "posenc_preset", lambda name=None: f"{name}_" if name not in (None, "None") else "")


def misspelled_keys(overrides: list[str], config_dir: Path) -> list[str]:
    """Overrides that set a key the composed config lacks, each with the nearest existing
    key: Hydra would refuse them with "not in struct" and no suggestion.

    The config is composed with the command's group choices (a sweep's first value of
    each); anything this check cannot parse is left to Hydra.

    Args:
        overrides: The command line's overrides (``model.d_modle=3``).
        config_dir: The ``conf/`` folder.

    Returns:
        One message per misspelled key (empty if none).
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(
            [o for o in overrides if not o.startswith(("hydra/", "hydra."))])
    except Exception:
        return []
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    choices = []
    for o in parsed:
        if o.key_or_group in groups and o.type is OverrideType.CHANGE:
            value = next(iter(o.sweep_iterator())) if o.is_sweep_override() else o.value()
            choices.append(f"{o.key_or_group}={value}")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            cfg = compose("config", overrides=choices)
    except Exception:
        return []
    found = []
    for o in parsed:
        key = o.key_or_group
        if o.type is not OverrideType.CHANGE or key in groups or "." not in key:
            continue
        parent, leaf = key.rsplit(".", 1)
        node = OmegaConf.select(cfg, parent)
        if not OmegaConf.is_dict(node) or leaf in node:
            continue
        keys = sorted(str(k) for k in node)
        close = difflib.get_close_matches(leaf, keys, n=1)
        hint = f"did you mean {parent}.{close[0]}?" if close else f"{parent} has {', '.join(keys)}"
        found.append(f"{key}: no such key; {hint}")
    return found


def record_failure(err: BaseException, run_dir: Path, seed: object) -> Path:
    """Write ``error.json`` (type, message, traceback, overrides, choices) atomically.

    Args:
        err: The exception the job raised.
        run_dir: The job's output directory.
        seed: The job's ``seed``.

    Returns:
        The path written (the job log instead if ``run_dir`` holds another run's results).
    """
    hc = HydraConfig.get()
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "error.json"
    if isinstance(err, RunDirError) or (run_dir / "metrics.json").exists():
        # Another run's results are here (e.g. two sweeps started in the same second):
        # an error.json next to them would mislabel that run, so only the log says it.
        return run_dir / "run.log"
    write_json_atomic(
        path,
        {
            "error_type": type(err).__name__,
            "message": str(err),
            "traceback": "".join(traceback.format_exception(err)),
            "overrides": list(hc.overrides.task),
            # The report groups failures by these, like finished runs.
            "task": hc.runtime.choices.get("task"),
            "encoder": hc.runtime.choices.get("encoder"),
            "seed": seed,
            "job_num": cast(DictConfig, hc.job).get("num"),  # a DictConfig, typed JobConf
        },
    )
    return path


def local_processes(devices: object, accelerator: object = "auto") -> int:
    """How many processes ``trainer.devices`` asks for on this node, counted as Lightning
    counts them: on a GPU (``accelerator`` gpu/cuda, or auto with CUDA present) by
    Lightning's own device parser, so ``auto`` and ``-1`` are every GPU of the node;
    on a CPU, ``devices`` is a process count (``auto``: one).

    Args:
        devices: ``trainer.devices``: an int, ``"auto"``, ``"2"``, ``"0,1"`` or a list.
        accelerator: ``trainer.accelerator``.
    """
    acc = str(accelerator).strip()
    if acc in ("gpu", "cuda") or (acc == "auto" and CUDAAccelerator.is_available()):
        if str(devices).strip() == "auto":
            return CUDAAccelerator.auto_device_count()
        # Lightning's parser also takes a ListConfig (any sequence of ints)
        return len(CUDAAccelerator.parse_devices(cast("int | str | list[int]", devices)) or [])
    if isinstance(devices, list | ListConfig):
        return len(devices)
    text = str(devices).strip()
    if text == "auto":
        return 1
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return 2 if int(text) == -1 else int(text)


def check_ddp_in_multirun(cfg: DictConfig) -> None:
    """Refuse a multi-process job inside a local multirun.

    Lightning starts extra ranks by re-running the command line, ``-m`` and all, so each
    rank would run the whole sweep and jobs would pair up with the wrong processes. Under
    SLURM (or torchrun) the ranks are created outside, one per task, which works.

    Raises:
        ValueError: ``trainer.devices`` asks for several processes and no cluster made them.
    """
    n = local_processes(cfg.trainer.get("devices", 1), cfg.trainer.get("accelerator", "auto"))
    if n > 1 and not (SLURMEnvironment.detect() or TorchElasticEnvironment.detect()):
        raise ValueError(
            f"trainer.devices={cfg.trainer.devices} in a local multirun: Lightning would "
            f"relaunch the whole sweep ({n} processes per job). Run multi-device jobs one at "
            f"a time (without -m), or sweep with hydra/launcher=slurm, which starts one task "
            f"per device."
        )


class Terminated(SystemExit):
    """SIGTERM arrived outside training (data loading, evaluation, decoding)."""

    def __init__(self) -> None:
        super().__init__(TERMINATED)


#: Exit status after SIGTERM, as a shell reports a process ended by it (128 + 15).
TERMINATED = 128 + signal.SIGTERM


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM: long loops outside Lightning (decoding) stop at their next step; with no
    trainer running (whose own handler then stops between two steps) stop right here."""
    stop.request_stop()
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        raise Terminated()


def _terminated(cfg: DictConfig) -> None:
    """Say where the run stopped and how to continue it, then exit with status 143."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    overrides = " ".join(o for o in HydraConfig.get().overrides.task
                         if not o.startswith(("hydra.run.dir=", "resume=")))
    if last.exists():
        print(f"stopped by SIGTERM; progress is saved in {last}. Continue with:\n  python "
              f"run.py {overrides} hydra.run.dir={run_dir} resume=true", file=sys.stderr)
    else:
        print(f"stopped by SIGTERM before any checkpoint was saved in {run_dir}",
              file=sys.stderr)
    sys.exit(TERMINATED)


def run_job(cfg: DictConfig) -> None:
    """Train and evaluate one job; inside a multirun, record a failure and go on.

    A single run with bad input (:class:`~posenc.errors.UserError`) prints the message
    alone, without a traceback, and exits with status 2. A job of a local multirun runs
    in a process of its own (:func:`_isolated`), so a job killed from outside (the
    out-of-memory killer, ``kill -9``) is recorded and the sweep goes on.
    """
    signal.signal(signal.SIGTERM, _on_sigterm)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            train(cfg)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            with contextlib.suppress(OSError):  # the run directory, if nothing is in it
                Path(HydraConfig.get().runtime.output_dir).rmdir()
            sys.exit(2)
        except (SIGTERMException, Terminated, stop.StopRequested):
            _terminated(cfg)
        return
    if _isolate():
        _isolated(cfg)
    else:
        _sweep_job(cfg)


def _sweep_job(cfg: DictConfig) -> None:
    """One multirun job in this process: a failure is recorded in ``error.json``."""
    try:
        check_ddp_in_multirun(cfg)
        train(cfg)
    except (SIGTERMException, Terminated, stop.StopRequested):
        _terminated(cfg)  # the scheduler stops the sweep: the other jobs end too
    except Exception as err:
        # One bad job must not end the sweep. Exception, not BaseException: Ctrl-C
        # (KeyboardInterrupt) still stops the whole sweep.
        path = record_failure(err, Path(HydraConfig.get().runtime.output_dir), cfg.get("seed"))
        if isinstance(err, UserError):  # bad input: the message says it all
            log.error("job refused: %s (recorded in %s)", err, path)
        else:
            log.exception("job failed (%s: %s); details in %s", type(err).__name__, err, path)


class JobKilled(Exception):
    """A sweep job's process ended without recording a result (e.g. ``SIGKILL``)."""


def _isolate() -> bool:
    """Local launchers (basic, joblib) run jobs in the sweep's own processes: give each
    job a process of its own. SLURM jobs are processes of their own already."""
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    return "submitit" not in target and "fork" in multiprocessing.get_all_start_methods()


def _isolated(cfg: DictConfig) -> None:
    """Run :func:`_sweep_job` in a forked process and wait for it. A SIGTERM to this
    process is passed on (the job saves ``last.ckpt``) and ends the sweep with 143; a job
    killed by a signal is recorded in its ``error.json`` and the sweep goes on."""
    proc = multiprocessing.get_context("fork").Process(target=_sweep_job, args=(cfg,))
    proc.start()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.terminate())
    try:
        proc.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = proc.exitcode
    assert code is not None  # join() returned: the process has ended
    if code == TERMINATED:  # the job said where it stopped and how to continue
        sys.exit(TERMINATED)
    if code == -signal.SIGTERM:
        _terminated(cfg)
    if code == 0:
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    how = (f"killed by {signal.Signals(-code).name}" if code < 0
           else f"ended with exit status {code}")
    hint = " (SIGKILL: often the out-of-memory killer)" if code == -signal.SIGKILL else ""
    err = JobKilled(f"the job's process was {how}{hint} before it recorded a result")
    path = record_failure(err, run_dir, cfg.get("seed"))
    log.error("job %s: %s; recorded in %s; the sweep goes on", run_dir.name, err, path)
