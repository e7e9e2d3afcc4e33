"""What ``run.py`` does with a composed config: one job, or one job of a sweep.

In a multirun (``-m``) a failing job writes ``<run dir>/error.json`` and the sweep goes
on with the next job; a single run raises as usual (non-zero exit). SIGTERM and SIGINT
(Ctrl-C) stop a run or a sweep alike: progress saved, the command that continues it
printed, exit status 128 + the signal's number.
"""

import contextlib
import copy
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, cast

import torch
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from lightning_fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict, read_write
from pytorch_lightning.accelerators import CUDAAccelerator
from pytorch_lightning.utilities.exceptions import MisconfigurationException, SIGTERMException
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from posenc import stop, tuned
from posenc.config import ConfigError, validate
from posenc.errors import RunDirError, UserError
from posenc.schema import integer
from posenc.train import train
from posenc.training.rundir import (
    forget_refused_run,
    release_error_space,
    space_for_error_record,
    write_failure,
    write_into_reserve,
    write_text_atomic,
)
from posenc.training.summary import sweep_resume_command
from posenc.training.trainer import override_keys

log = logging.getLogger("posenc.run")


def record_failure(
    err: BaseException, run_dir: Path, seed: object, label: object = None
) -> Path | None:
    """Write ``error.json`` (type, message, traceback, overrides, choices) atomically; a
    failed write (:func:`~posenc.training.rundir.write_failure`: "no space left on
    device: <file>") is named in its ``write_failure``. On a full disk the record goes
    into the space the job held back (:func:`~posenc.training.rundir.space_for_error_record`).
    Never raises: a record that cannot be written at all is said in one log line.

    Args:
        err: The exception the job raised.
        run_dir: The job's output directory.
        seed: The job's ``seed``.
        label: The job's ``label`` (its scheme's name in results), if it sets one.

    Returns:
        The path written (the job log instead if ``run_dir`` holds another run's results),
        or None if nothing could be written.
    """
    hc = HydraConfig.get()
    path = run_dir / "error.json"
    if isinstance(err, RunDirError) or (run_dir / "metrics.json").exists():
        # Another run's results are here (e.g. two sweeps started in the same second):
        # an error.json next to them would mislabel that run, so only the log says it.
        return run_dir / "run.log"
    record = {
        "error_type": type(err).__name__,
        "message": str(err),
        "write_failure": write_failure(err),
        "traceback": "".join(traceback.format_exception(err)),
        "overrides": list(hc.overrides.task),
        # The report groups failures by these, like finished runs.
        "task": hc.runtime.choices.get("task"),
        "encoder": label or hc.runtime.choices.get("encoder"),
        "seed": seed,
        "job_num": cast(DictConfig, hc.job).get("num"),  # a DictConfig, typed JobConf
    }
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=2, default=str))
    except OSError as full:
        try:
            write_into_reserve(path, record)
        except OSError:
            why = write_failure(full) or full.strerror or str(full)
            log.error("could not record this job's failure in %s (%s): %s", path, why, err)
            return None
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
        try:
            return len(CUDAAccelerator.parse_devices(cast("int | str | list[int]", devices)) or [])
        except MisconfigurationException:  # GPUs this machine lacks: the job's checks say so
            return 0
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


#: The signals that stop a run or a sweep the same way (save, say how to continue).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(by: str | None = None) -> int:
    """128 + the number of the signal named ``by`` (default: the one that stopped this
    process, :func:`posenc.stop.stopped_by`), as a shell reports a process a signal
    ended: 143 after SIGTERM, 130 after SIGINT (Ctrl-C)."""
    return 128 + signal.Signals[by or stop.stopped_by()]


class Terminated(SystemExit):
    """SIGTERM or SIGINT arrived outside training (data loading, evaluation, decoding)."""

    def __init__(self) -> None:
        super().__init__(exit_status())


def _on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM: long loops outside Lightning (decoding) stop at their next step; with no
    trainer running (whose own handler then stops between two steps) stop right here."""
    stop.request_stop()
    if signal.getsignal(signal.SIGTERM) is _on_sigterm:
        raise Terminated()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGINT (Ctrl-C): stop as on SIGTERM, through whatever handles SIGTERM now
    (Lightning's handler during training, which stops between two steps and saves
    ``last.ckpt``; :func:`_on_sigterm` otherwise), with SIGINT named as the cause. Python's
    KeyboardInterrupt would instead end training with exit status 1 and nothing saved."""
    stop.request_stop("SIGINT")
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        # Lightning's handler logs a line; when this signal interrupted a log line's own
        # write, that nested write fails and logging would print "--- Logging error ---"
        # with a traceback. Such a line is dropped instead; the run's own lines follow.
        shown = logging.raiseExceptions
        logging.raiseExceptions = False
        try:
            handler(signal.SIGTERM, frame)
        finally:
            logging.raiseExceptions = shown


def _handle_stop_signals() -> None:
    """SIGTERM and SIGINT stop this run (:func:`_on_sigterm`, :func:`_on_sigint`). A SIGINT
    ignored from the start (a command a script started with ``&``) stays ignored, as
    Python itself leaves it."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_sigint)


#: Set by :class:`SweepSignals` to the sweep's own process id, for its pool's workers.
SWEEP_PID = "POSENC_SWEEP_PID"


def _in_pool_worker() -> bool:
    """This process is a worker of the ``local_parallel`` (joblib) launcher's pool, not
    the sweep's own process (where joblib runs the jobs itself when ``n_jobs=1``)."""
    here = str(os.getpid())
    return "joblib" in str(HydraConfig.get().launcher.get("_target_", "")) and (
        os.environ.get(SWEEP_PID, here) != here
    )


def _say_stopped(by: str | None = None) -> None:
    """Say where this run stopped (by the signal named ``by``; default: the one that
    stopped this process) and how to continue it."""
    by = by or stop.stopped_by()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    overrides = " ".join(
        o
        for o in HydraConfig.get().overrides.task
        if not o.startswith(("hydra.run.dir=", "resume="))
    )
    if last.exists():
        print(
            f"stopped by {by}; progress is saved in {last}. Continue with:\n  python "
            f"run.py {overrides} hydra.run.dir={run_dir} resume=true",
            file=sys.stderr,
        )
    else:
        print(f"stopped by {by} before any checkpoint was saved in {run_dir}", file=sys.stderr)


def _terminated(cfg: DictConfig) -> None:
    """Say where the run stopped and how to continue it, then exit with status 143 (SIGTERM)
    or 130 (SIGINT)."""
    for signum in STOP_SIGNALS:  # a second Ctrl-C while this is said: no traceback
        signal.signal(signum, signal.SIG_IGN)
    if getattr(rank_zero_only, "rank", 0) == 0:  # the first of several processes says it
        _say_stopped()
    sys.exit(exit_status())


def _say_sweep_stopped(sweep_dir: Path, by: str) -> None:
    done = sum(1 for _ in sweep_dir.glob("*/metrics.json"))
    print(
        f"sweep stopped by {by} ({done} jobs finished) in {sweep_dir}. Continue the "
        f"sweep with:\n  {sweep_resume_command(sweep_dir, sys.argv)}",
        file=sys.stderr,
        flush=True,
    )


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from ``/proc``; ``ps`` where there is none)."""
    found = []
    proc = Path("/proc")
    if proc.is_dir():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            # "pid (name) state ppid ...": the name may hold spaces and parentheses
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
        return found
    out = subprocess.run(
        ["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False
    ).stdout
    return [int(a) for a, b in (line.split() for line in out.splitlines()) if int(b) == pid]


def _jobs_of(workers: list[int]) -> list[int]:
    """The living processes below the pool's ``workers`` (their jobs and what those
    started)."""
    found: list[int] = []
    below = [c for w in workers for c in _children(w)]
    while below:
        pid = below.pop()
        if _alive(pid):
            found.append(pid)
            below.extend(_children(pid))
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _writable_folder(path: Path) -> str | None:
    """Why ``path`` cannot be made and written into, or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        return err.strerror or str(err)
    return None


class OutputDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): a run or sweep
    directory that cannot be created or written is one line and exit status 2, before
    Hydra makes it (Hydra's own ``mkdir`` fails with a traceback)."""

    def _check(self, key: str, path: Path) -> None:
        why = _writable_folder(path)
        if why is not None:
            print(
                f"error: {key}={path}: cannot create or write this folder ({why}); pick "
                f"another {key}, or make it writable",
                file=sys.stderr,
            )
            sys.exit(2)

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        self._check("hydra.run.dir", Path(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        self._check("hydra.sweep.dir", Path(str(config.hydra.sweep.dir)))


class SweepCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): every job of a
    multirun is composed and checked (:func:`posenc.config.validate`, after ``+tuned``)
    before the first one starts. A sweep holding a job that would be refused stops here
    with one line per such job (its own overrides, then each problem) and exit status 2,
    instead of refusing it hours into the sweep. Checks that need the loaded data (the
    LM batch, the passkey lengths) or the job's machine (the cache folder, an
    algorithmic task's memory; the jobs may run elsewhere, and nothing here may ask
    torch about CUDA before the launcher forks the jobs) still run in each job.

    Only the basic sweeper's grids are expanded (every sweep this project ships); another
    sweeper's jobs are checked one by one as they start.
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        launcher = config.hydra.launcher
        n_jobs = launcher.get("n_jobs")
        if "joblib" in str(launcher.get("_target_", "")) and not (integer(n_jobs) and n_jobs):
            print(
                f"error: hydra.launcher.n_jobs={n_jobs!r}: must be the number of jobs to run "
                "at a time (a positive integer), or -1 for one per core",
                file=sys.stderr,
            )
            sys.exit(2)
        if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
            return
        tic = time.perf_counter()
        grid = sweep_jobs(config)
        if len(grid) > 1:  # a large grid takes a while (seconds per distinct composition)
            log.info("checking the configs of %d jobs before starting any ...", len(grid))
        with _one_thread():
            refused = sweep_problems(config, grid)
        n_jobs = len(grid)
        if not refused:
            log.info(
                "checked the configs of %d jobs before starting any: no problem (%.1f s)",
                n_jobs,
                time.perf_counter() - tic,
            )
            return
        groups: dict[tuple[str, ...], list[str]] = {}
        for job, job_problems in refused:
            groups.setdefault(tuple(job_problems), []).append(job)
        lines = [
            f"{len(refused)} of {n_jobs} jobs of this sweep would be refused; none was started:"
        ]
        for shared, jobs in groups.items():
            if len(jobs) == n_jobs:
                who = "every job"
            elif len(jobs) > 3:
                who = f"{'; '.join(jobs[:3])} and {len(jobs) - 3} more"
            else:
                who = "; ".join(jobs)
            lines += [f"  {who}:"] + [f"    {p}" for p in shared]
        lines.append("Fix those values, or leave those combinations out of the sweep.")
        with contextlib.suppress(OSError):  # the sweep directory, if nothing is in it
            Path(str(config.hydra.sweep.dir)).rmdir()
        print("error: " + "\n".join(lines), file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Torch on one thread inside. The sweep's process forks its jobs afterwards
    (:func:`_isolated`), and GNU OpenMP is not fork-safe: once a parallel op has started
    its thread pool (building a T5 encoder's bucket table does), a forked job waits
    forever at its own first parallel op, and a stop signal cannot reach it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def sweep_jobs(config: DictConfig) -> list[list[str]]:
    """The overrides of each job the basic sweeper will launch, in its order: the preset's
    ``hydra.sweeper.params``, then the command line's overrides (which win)."""
    # unresolved, as the sweeper reads them: a job resolves its ${...} in its own config
    params = config.hydra.sweeper.get("params")
    params = OmegaConf.to_container(params, resolve=False) if params else {}
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    arguments = [f"{k}={v}" for k, v in cast(dict, params).items()] + cast(list, task)
    loader = GlobalHydra.instance().config_loader()  # for glob() choice sweeps
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def sweep_problems(
    config: DictConfig, jobs: list[list[str]] | None = None
) -> list[tuple[str, list[str]]]:
    """``(the job's varying overrides, its problems)`` for every job of the sweep
    ``config`` (the multirun's own config) that :func:`posenc.config.validate` refuses;
    ``jobs``: its :func:`sweep_jobs`, if already expanded."""
    jobs = sweep_jobs(config) if jobs is None else jobs
    varying = {o.partition("=")[0] for o in jobs[0]} if jobs else set()
    varying = {k for k in varying if len({o for j in jobs for o in j if o.startswith(k + "=")}) > 1}
    hydra_config = HydraConfig.instance()
    master = hydra_config.cfg
    refused = []
    # The checks read the seed only to refuse a negative one: jobs that differ only in a
    # seed >= 0 share one check.
    checked: dict[tuple[str, ...], list[str]] = {}
    try:
        unseeded = [tuple(o for o in job if not re.fullmatch(r"seed=\d+", o)) for job in jobs]
        for same, (job, cfg) in zip(
            unseeded, job_configs(config, jobs, lambda i: unseeded[i] not in checked), strict=True
        ):
            if cfg is not None:
                checked[same] = _job_problems(cfg, job)
            if checked[same]:
                name = " ".join(o for o in job if o.partition("=")[0] in varying) or " ".join(job)
                refused.append((name, checked[same]))
    finally:
        hydra_config.cfg = master  # the sweep's own again (None outside Hydra)
    return refused


def job_configs(
    config: DictConfig,
    jobs: list[list[str]],
    wanted: Callable[[int], bool] = lambda i: True,
) -> Iterator[tuple[list[str], DictConfig | None]]:
    """``(job, its config)`` for each job of the sweep ``config``, in order, as its
    launcher composes it (``load_sweep_config``), or None for the jobs whose index
    ``wanted`` declines (asked as the jobs come: a job may decline what an earlier one
    found). Hydra builds a config from the group overrides (``encoder=...``,
    ``+variant=...``) and then applies the others (``key=value``) to it: so each distinct
    choice of groups is composed once and each job gets a copy with its values applied by
    Hydra's own function (chomsky's 900 jobs have 10 such choices; composing each job took
    minutes). Each config comes without its ``hydra``, which is set as the current one
    (``${hydra:...}`` reads it): its group choices'."""
    loader = GlobalHydra.instance().config_loader()
    parse = OverridesParser.create(config_loader=loader).parse_overrides
    repo = cast(Any, loader).repository
    composed: dict[tuple[str, ...], tuple[DictConfig, Any]] = {}
    for i, job in enumerate(jobs):
        if not wanted(i):
            yield job, None
            continue
        parsed = parse(list(job))
        # Hydra's own test of a group override (hydra._internal.defaults_list.Overrides)
        group = [
            repo.group_exists(o.key_or_group) and not isinstance(o.value(), dict) for o in parsed
        ]
        groups = tuple(str(o.input_line) for o, g in zip(parsed, group, strict=True) if g)
        if groups not in composed:
            cfg = loader.load_sweep_config(config, list(groups))
            HydraConfig.instance().set_config(cfg)  # its own copy of cfg.hydra
            with open_dict(cfg):
                del cfg["hydra"]
            composed[groups] = cfg, HydraConfig.instance().cfg
        cfg, hydra = composed[groups]
        cfg, HydraConfig.instance().cfg = copy.deepcopy(cfg), hydra
        # (a value for hydra.* changes how the job is run, not what it is)
        values = [
            o
            for o, g in zip(parsed, group, strict=True)
            if not g and not o.key_or_group.startswith("hydra.")
        ]
        type(loader)._apply_overrides_to_config(values, cfg)  # type: ignore[attr-defined]
        yield job, cfg


def _job_problems(cfg: DictConfig, job: list[str]) -> list[str]:
    """The problems :func:`posenc.config.validate` finds in one job's config (``job``:
    its overrides)."""
    try:
        tuned.apply(cfg, override_keys(job))
        # the jobs check their machine themselves; the config is this check's own copy
        validate(cfg, machine=False, copy=False)
    except ConfigError as err:
        return err.problems
    return []


class SweepSignals(Callback):
    """Hydra callback (``hydra.callbacks`` in ``conf/config.yaml``): SIGTERM or SIGINT
    (Ctrl-C) to a ``local_parallel`` sweep stops it as it stops a single run.

    That launcher runs the jobs in a pool of worker processes and nothing of posenc runs
    in the sweep's own process, which would end at once (on SIGINT with joblib's
    KeyboardInterrupt traceback) and leave its workers training on. Here the sweep's
    process passes the signal on to the workers' jobs (each stops between two steps,
    saves ``last.ckpt`` and says how to continue it), waits for every job to end, ends
    the workers, prints the command that continues the whole sweep and exits with 143
    (SIGTERM) or 130 (SIGINT). The basic launcher runs jobs in the sweep's process:
    :func:`run_job` handles it.

    Args:
        grace_s: How long to wait for the workers to end before exiting anyway.
    """

    def __init__(self, grace_s: float = 300.0) -> None:
        self.grace_s = grace_s

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        if "joblib" not in str(config.hydra.launcher.get("_target_", "")):
            return
        _no_idle_workers(config)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        main = os.getpid()
        os.environ[SWEEP_PID] = str(main)  # the pool's workers inherit it

        def stop_sweep(signum: int, frame: object) -> None:
            for each in STOP_SIGNALS:  # a second signal (Ctrl-C again) while waiting
                signal.signal(each, signal.SIG_IGN)
            by = signal.Signals(signum).name
            # The pool's workers; its resource trackers end by themselves with this process.
            workers = [p for p in _children(main) if "resource_tracker" not in _command_line(p)]
            # The signal goes to each job (a worker's child), and to a job that starts
            # meanwhile: it saves last.ckpt and ends, and its worker then stays
            # (_await_sweep_end). Not to the workers: one that ended would make the pool
            # kill the others, and their jobs with them, perhaps in the middle of saving.
            # (Ctrl-C reaches every process of the group by itself.)
            told: set[int] = set()
            deadline = time.monotonic() + self.grace_s
            while time.monotonic() < deadline:
                for pid in {c for w in workers for c in _children(w)} - told:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
                    told.add(pid)
                if not _jobs_of(workers):
                    break
                time.sleep(0.2)
            if jobs := _jobs_of(workers):
                print(
                    f"jobs {', '.join(map(str, jobs))} did not end within "
                    f"{self.grace_s:.0f} s of {by}",
                    file=sys.stderr,
                )
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for pid in workers:  # reap them: no zombie is left behind
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            _say_sweep_stopped(sweep_dir, by)
            sys.stdout.flush()
            sys.exit(exit_status(by))

        signal.signal(signal.SIGTERM, stop_sweep)
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, stop_sweep)


def _no_idle_workers(config: DictConfig) -> None:
    """At most as many pool workers as the sweep has jobs: a worker that never had a job
    dies on Ctrl-C (Python's KeyboardInterrupt), and the pool then kills every other
    worker with its job. Only the basic sweeper's grids are counted."""
    if "BasicSweeper" not in str(config.hydra.sweeper.get("_target_", "")):
        return
    jobs = len(sweep_jobs(config))
    n_jobs = int(config.hydra.launcher.get("n_jobs") or 1)
    workers = (os.cpu_count() or 1) + 1 + n_jobs if n_jobs < 0 else n_jobs  # joblib's rule
    if jobs < workers:
        with read_write(config.hydra.launcher), open_dict(config.hydra.launcher):
            config.hydra.launcher.n_jobs = max(jobs, 1)


def run_job(cfg: DictConfig) -> None:
    """Train and evaluate one job; inside a multirun, record a failure and go on.

    A single run with bad input (:class:`~posenc.errors.UserError`) prints the message
    alone, without a traceback, and exits with status 2. A job of a local multirun runs
    in a process of its own (:func:`_isolated`), so a job killed from outside (the
    out-of-memory killer, ``kill -9``) is recorded and the sweep goes on; it holds disk
    space back for its ``error.json`` while it runs. SIGTERM and SIGINT stop a run or a
    sweep: progress saved, the command that continues it printed, exit 143 or 130.
    """
    _handle_stop_signals()
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        fresh = not run_dir.exists() or not any(run_dir.iterdir())
        try:
            train(cfg)
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            if fresh:  # a refused run leaves no folder that reads as a run killed early
                forget_refused_run(run_dir)
            sys.exit(2)
        except (SIGTERMException, Terminated, stop.StopRequested):
            _terminated(cfg)
        return
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.get("resume") and (run_dir / "metrics.json").exists():
        # A stopped sweep resumed: this job's results stay as they are.
        log.info("job %s finished already (metrics.json): skipped", run_dir.name)
        return
    stopped_by = None  # a job in this process (_sweep_job) ends the sweep itself
    with space_for_error_record(run_dir):
        if _isolate():
            stopped_by = _isolated(cfg)
        else:
            _sweep_job(cfg)
    if stopped_by is not None:
        _end_sweep(stopped_by)


def _sweep_job(cfg: DictConfig) -> None:
    """One multirun job in this process: a failure is recorded in ``error.json``."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        check_ddp_in_multirun(cfg)
        train(cfg)
    except (SIGTERMException, Terminated, stop.StopRequested):
        _terminated(cfg)  # the scheduler (or Ctrl-C) stops the sweep: the other jobs end too
    except Exception as err:
        # One bad job must not end the sweep. Exception, not BaseException: a stop
        # (Terminated, a SystemExit) still ends the whole sweep.
        path = record_failure(err, run_dir, cfg.get("seed"), cfg.get("label"))
        where = f"recorded in {path}" if path else "not recorded"
        if isinstance(err, UserError):  # bad input: the message says it all
            log.error("job refused: %s (%s)", err, where)
        else:
            log.exception("job failed (%s: %s); %s", type(err).__name__, err, where)


class JobKilled(Exception):
    """A sweep job's process ended without recording a result (e.g. ``SIGKILL``)."""


def _isolate() -> bool:
    """Local launchers (basic, joblib) run jobs in the sweep's own processes: give each
    job a process of its own. SLURM jobs are processes of their own already."""
    target = str(HydraConfig.get().launcher.get("_target_", ""))
    return "submitit" not in target and "fork" in multiprocessing.get_all_start_methods()


def _end_sweep(by: str) -> None:
    """A job was stopped by the signal named ``by``: end this process (143 or 130)."""
    if _in_pool_worker():
        # Not SystemExit: the pool would catch it and hand this worker the next job.
        _await_sweep_end(exit_status(by))
    _say_sweep_stopped(Path(str(HydraConfig.get().sweep.dir)), by)
    sys.exit(exit_status(by))


def _pass_on(pid: int) -> Callable[[int, FrameType | None], None]:
    """A signal handler that passes the signal on to process ``pid``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.request_stop(signal.Signals(signum).name)
        with contextlib.suppress(ProcessLookupError):  # it has ended meanwhile
            os.kill(pid, signum)

    return handler


def _end_worker(run_dir: Path) -> Callable[[int, FrameType | None], None]:
    """A signal handler for a pool worker without a job: give back the space held in
    ``run_dir`` for an error record (the job that has just ended may not have yet), then
    :func:`_await_sweep_end`."""

    def handler(signum: int, frame: FrameType | None) -> None:
        release_error_space(run_dir)
        _await_sweep_end(128 + signum)

    return handler


def _await_sweep_end(status: int) -> NoReturn:
    """In a pool worker whose job has ended on a stop signal: take no other job and stay
    until the sweep's process (:class:`SweepSignals`) ends this worker, once every job of
    the sweep has ended; exit with ``status`` if that process has gone. A worker ending
    by itself would make the pool (loky) kill the other workers and their jobs at once,
    perhaps in the middle of saving their checkpoints."""
    for each in STOP_SIGNALS:
        signal.signal(each, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    sweep = os.getppid()
    while os.getppid() == sweep:
        time.sleep(0.2)
    os._exit(status)


def _isolated(cfg: DictConfig) -> str | None:
    """Run :func:`_sweep_job` in a forked process and wait for it. SIGTERM or SIGINT to
    this process is passed on (the job saves ``last.ckpt``); a job killed by another
    signal is recorded in its ``error.json`` and the sweep goes on.

    Returns:
        The name of the signal that stopped the job (the sweep ends), or None.
    """
    proc = multiprocessing.get_context("fork").Process(target=_sweep_job, args=(cfg,))
    proc.start()
    assert proc.pid is not None  # started
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, was in previous.items():
        if was is not signal.SIG_IGN:
            signal.signal(s, _pass_on(proc.pid))
    try:
        proc.join()
    finally:
        # From here a stop signal (Ctrl-C reaches the whole process group) makes a pool
        # worker wait for the sweep to end it, giving back the job's held space first:
        # it may arrive before `space_for_error_record` has left.
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        for s, was in previous.items():
            keep = was is signal.SIG_IGN or not _in_pool_worker()
            signal.signal(s, was if keep else _end_worker(run_dir))
    code = proc.exitcode
    assert code is not None  # join() returned: the process has ended
    for s in STOP_SIGNALS:
        if code in (128 + s, -s):
            if code < 0:  # ended before it could say so itself
                _say_stopped(s.name)
            return s.name
    if code == 0:  # finished; a signal that came as it did still ends the sweep
        return stop.stopped_by() if stop.stop_requested() else None
    how = (
        f"killed by {signal.Signals(-code).name}" if code < 0 else f"ended with exit status {code}"
    )
    hint = " (SIGKILL: often the out-of-memory killer)" if code == -signal.SIGKILL else ""
    err = JobKilled(f"the job's process was {how}{hint} before it recorded a result")
    path = record_failure(err, run_dir, cfg.get("seed"), cfg.get("label"))
    where = f"recorded in {path}" if path else "not recorded"
    log.error("job %s: %s; %s; the sweep goes on", run_dir.name, err, where)
    return None
