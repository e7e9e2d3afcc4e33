"""A sweep stopped from outside: a job killed (as by the out-of-memory killer), SIGTERM
and Ctrl-C to the sweep, each saving what it can and saying how to continue."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posenc import cli, stop
from posenc.report import build_report
from tests.conftest import ROOT, children


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_a_killed_job_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """SIGKILL of one job's process (as the out-of-memory killer does) in a local_parallel
    sweep: the other jobs finish, the dead one gets an error.json saying how it ended,
    and the report names it."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    from tests.conftest import TINY

    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    out = tmp_path / "multirun"
    proc = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "-m",
            "hydra/launcher=local_parallel",
            *tiny,
            "encoder=none,rope,alibi",
            "trainer.max_steps=150",
            "trainer.val_check_interval=50",
            f"hydra.sweep.dir={out}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Jobs run two at a time in joblib workers (children of the sweep), each job in a
    # process of its own (a grandchild): kill one once training has begun.
    victim, deadline = None, time.monotonic() + 240
    while victim is None and proc.poll() is None and time.monotonic() < deadline:
        jobs = [g for c in children(proc.pid) for g in children(c)]
        if jobs and list(out.glob("*/tb")):
            victim = jobs[0]
        time.sleep(0.05)
    assert victim is not None, "no job process found"
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    dirs = sorted(d for d in out.iterdir() if d.is_dir())
    results = {
        d.name: [p.name for p in (d / "metrics.json", d / "error.json") if p.exists()] for d in dirs
    }
    assert sorted(map(tuple, results.values())) == [
        ("error.json",),
        ("metrics.json",),
        ("metrics.json",),
    ], results
    dead = next(d for d in dirs if (d / "error.json").exists())
    record = json.loads((dead / "error.json").read_text())
    assert record["error_type"] == "JobKilled"
    assert "killed by SIGKILL" in record["message"]
    build_report(out)
    report = (out / "report" / "report.md").read_text()
    assert f"| {dead.name} | failed |" in report and "killed by SIGKILL" in report


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _start_sweep_and_wait(
    out: Path, cache: Path, *overrides: str, ckpts: int, encoders: str = "none,rope"
) -> subprocess.Popen:
    """A tiny sweep (two jobs, ``encoder=none,rope``, 300 steps, a checkpoint every step)
    in its own process group, as a terminal starts it, once ``ckpts`` jobs have saved."""
    from tests.conftest import TINY

    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    proc = subprocess.Popen(
        [
            sys.executable,
            "run.py",
            "-m",
            *overrides,
            *tiny,
            f"encoder={encoders}",
            "trainer.max_steps=300",
            "trainer.val_check_interval=300",
            "checkpoint_every_n_steps=1",
            f"hydra.sweep.dir={out}",
            f"paths.cache_dir={cache}",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while len(list(out.glob("*/checkpoints/last.ckpt"))) < ckpts and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    return proc


def _family(pid: int) -> list[int]:
    """``pid``'s children and grandchildren (a sweep's workers and their jobs)."""
    family = list(children(pid))
    return family + [g for c in family for g in children(c)]


def _none_outlives(family: list[int]) -> None:
    # (the pool's resource tracker ends on its own once the sweep's process has gone)
    deadline = time.monotonic() + 10
    while [p for p in family if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if _alive(p)], "processes outlived the sweep"


def _resume_command(err: str) -> list[str]:
    """The command a stopped sweep printed to continue it, to run as printed."""
    resume = err.split("Continue the sweep with:\n", 1)[1].splitlines()[0].split()
    assert resume[:2] == ["python", "run.py"] and resume[-1] == "resume=true", resume
    return [sys.executable, *resume[1:]]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_sigterm_to_a_parallel_sweep_stops_its_jobs_and_says_how_to_resume(tmp_path: Path) -> None:
    """SIGTERM to a ``local_parallel`` sweep: both running jobs save ``last.ckpt`` and
    stop, no worker or job process outlives the sweep, which exits 143 printing the
    command that continues it; that command finishes both jobs from their checkpoints,
    and run once more skips them (#38: the jobs ran on as
    orphans and wrote metrics.json after the sweep had "ended")."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    out = tmp_path / "multirun"
    proc = _start_sweep_and_wait(out, tmp_path / "cache", "hydra/launcher=local_parallel", ckpts=2)
    family = _family(proc.pid)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    _none_outlives(family)
    assert err.count("stopped by SIGTERM; progress is saved in") == 2, err[-3000:]
    assert not list(out.glob("*/metrics.json"))
    # As printed, with checkpoints less often (a setting a resumed run may change).
    resume = [*_resume_command(err), "checkpoint_every_n_steps=1000"]
    again = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(list(out.glob("*/metrics.json"))) == 2
    for d in out.glob("*/checkpoints"):  # each continued from where it stopped
        log = (d.parent / "run.log").read_text()
        assert "SIGTERM at step" in log and f"continuing from {d / 'last.ckpt'}" in log, log
    before = {p: p.read_bytes() for p in out.glob("*/metrics.json")}
    skipped = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    said = skipped.stdout + skipped.stderr
    assert said.count("finished already (metrics.json): skipped") == 2, said[-3000:]
    assert {p: p.read_bytes() for p in out.glob("*/metrics.json")} == before


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize(("launcher", "running"), [("local_parallel", 2), ("basic", 1)])
def test_ctrl_c_to_a_sweep_stops_it_as_sigterm_does_with_exit_130(
    tmp_path: Path, launcher: str, running: int
) -> None:
    """SIGINT to a sweep's process group, as Ctrl-C in a terminal sends it: each running
    job saves ``last.ckpt`` and says how to continue it, no process outlives the sweep,
    which exits 130 printing the command that continues it, without a traceback (joblib's
    KeyboardInterrupt traceback and exit status 1 before, with no resume command)."""
    if launcher == "local_parallel":
        pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("SIGINT is ignored here, and so in the sweep this test starts")
    out = tmp_path / "multirun"
    proc = _start_sweep_and_wait(
        out, tmp_path / "cache", f"hydra/launcher={launcher}", ckpts=running
    )
    family = _family(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    said, err = proc.communicate(timeout=300)
    said += err
    assert proc.returncode == 130, said[-3000:]
    _none_outlives(family)
    assert "Traceback" not in said and "KeyboardInterrupt" not in said, said[-3000:]
    assert err.count("stopped by SIGINT; progress is saved in") == running, err[-3000:]
    assert "sweep stopped by SIGINT (0 jobs finished)" in err, err[-3000:]
    resume = _resume_command(err)
    assert f"hydra/launcher={launcher}" in resume and f"hydra.sweep.dir={out}" in resume
    assert not list(out.glob("*/metrics.json")) and not list(out.glob("*/.error.json*"))
    for ckpt in out.glob("*/checkpoints/last.ckpt"):
        log = (ckpt.parent.parent / "run.log").read_text()
        assert "SIGINT at step" in log and f"saved {ckpt}" in log, log


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_a_sweep_smaller_than_its_pool_starts_no_idle_worker_that_ctrl_c_would_end(
    tmp_path: Path,
) -> None:
    """One job with ``n_jobs=3``: no pool of three, whose two workers without a job would
    end on Ctrl-C (KeyboardInterrupt) and make the pool kill the third with its job, in
    the middle of saving; joblib runs the one job itself (``n_jobs=1``), and Ctrl-C saves
    it and says so."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("SIGINT is ignored here, and so in the sweep this test starts")
    out = tmp_path / "multirun"
    proc = _start_sweep_and_wait(
        out,
        tmp_path / "cache",
        "hydra/launcher=local_parallel",
        "hydra.launcher.n_jobs=3",
        ckpts=1,
        encoders="none",
    )
    os.killpg(proc.pid, signal.SIGINT)
    said, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Joblib.Parallel(n_jobs=1," in said, said[-3000:]
    assert err.count("stopped by SIGINT; progress is saved in") == 1, err[-3000:]
    assert not list(out.glob("*/.error.json*"))


def test_a_ctrl_c_that_interrupts_a_log_line_prints_no_logging_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C passes on to the SIGTERM handler (Lightning's, which logs a line). When the
    signal arrived while a log line was being written, that nested write fails ("reentrant
    call"), and logging printed "--- Logging error ---" and a traceback: the line is
    dropped instead, and logging's setting is as it was."""

    class Busy(io.StringIO):
        def write(self, s: str) -> int:
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

    log = logging.getLogger("tests.sigint")
    monkeypatch.setattr(log, "handlers", [logging.StreamHandler(Busy())])
    monkeypatch.setattr(log, "propagate", False)
    monkeypatch.setattr(log, "level", logging.INFO)
    called = []
    monkeypatch.setattr(
        signal, "getsignal", lambda s: lambda *_: called.append(s) or log.info("Received SIGTERM")
    )
    monkeypatch.setattr(stop, "request_stop", lambda *_: None)
    assert logging.raiseExceptions
    cli._on_sigint(signal.SIGINT, None)
    assert called == [signal.SIGTERM]
    assert "Logging error" not in capsys.readouterr().err
    assert logging.raiseExceptions
