"""The smoke sweep for real (one job deliberately broken), its report, the launchers and
the checks of a sweep before launch (presets: test_sweep_presets.py; signals:
test_sweep_signals.py)."""

from __future__ import annotations

import csv
import errno
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict
from torch import Tensor

from posenc import cli as run
from posenc.encoders.none import NoPositions
from posenc.errors import CheckpointError
from posenc.report import build_report
from posenc.training.rundir import space_for_error_record
from tests.conftest import ROOT, compose_hydra, multirun_config


class BrokenEncoder(NoPositions):
    """Builds and validates fine, then fails inside training (at the first forward)."""

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        raise RuntimeError("deliberately broken encoder: embed() raises")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python run.py -m sweep=smoke`` plus a third encoder, ``broken``, from a test
    config dir: 3 encoders x 2 seeds, the 2 broken jobs among the others."""
    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "conf" / "encoder").mkdir(parents=True)
    (tmp / "conf" / "encoder" / "broken.yaml").write_text(
        f"_target_: {__name__}.BrokenEncoder\n_partial_: true\n"
    )
    out = tmp / "multirun"
    proc = subprocess.run(
        [
            sys.executable,
            "run.py",
            "-m",
            "sweep=smoke",
            "encoder=learned,broken,rope",
            f"hydra.sweep.dir={out}",
            f"paths.cache_dir={tmp / 'cache'}",
            f"hydra.searchpath=[file://{tmp / 'conf'}]",
        ],
        cwd=ROOT,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    # The sweep as a whole succeeds: a failed job is recorded, not raised.
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def job_dirs(sweep: Path) -> list[Path]:
    return sorted(d for d in sweep.iterdir() if d.is_dir() and d.name != "report")


def test_every_job_has_its_own_dir_and_one_result(sweep: Path) -> None:
    dirs = job_dirs(sweep)
    assert [d.name for d in dirs] == [
        "0_lm_learned_seed0",
        "1_lm_learned_seed1",
        "2_lm_broken_seed0",
        "3_lm_broken_seed1",
        "4_lm_rope_seed0",
        "5_lm_rope_seed1",
    ]
    for d in dirs:
        results = [p.name for p in (d / "metrics.json", d / "error.json") if p.exists()]
        assert results == (["error.json"] if "broken" in d.name else ["metrics.json"]), d


def test_failed_job_is_recorded(sweep: Path) -> None:
    err = json.loads((sweep / "3_lm_broken_seed1" / "error.json").read_text())
    assert err["error_type"] == "RuntimeError"
    assert err["message"] == "deliberately broken encoder: embed() raises"
    assert "in embed" in err["traceback"]
    assert "encoder=broken" in err["overrides"] and "seed=1" in err["overrides"]
    assert (err["task"], err["encoder"], err["seed"]) == ("lm", "broken", 1)


def test_report_numbers_match_the_runs(sweep: Path) -> None:
    rep = build_report(sweep)
    with (sweep / "report" / "report.csv").open() as f:
        rows = {(r["encoder"], r["metric"]): r for r in csv.DictReader(f)}
    by_encoder: dict[str, list[dict]] = {}
    for d in job_dirs(sweep):
        if (d / "metrics.json").exists():
            m = json.loads((d / "metrics.json").read_text())
            by_encoder.setdefault(m["encoder"], []).append(m)
    assert sorted(by_encoder) == ["learned", "rope"] and len(rep.runs) == 4
    checked = 0
    for encoder, runs in by_encoder.items():
        assert len(runs) == 2
        for metric in runs[0]["metrics"]:
            values = [r["metrics"][metric] for r in runs]
            row = rows[encoder, metric]
            assert float(row["mean"]) == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert float(row["std"]) == pytest.approx(statistics.stdev(values), rel=1e-12)
            assert row["n"] == "2" and row["skipped"] == "0"
            checked += 1
        assert float(rows[encoder, "test/ppl@16"]["n_params"]) == runs[0]["n_params"]
        assert float(rows[encoder, "test/ppl@16"]["tokens_per_s"]) == pytest.approx(
            statistics.fmean(r["tokens_per_s"] for r in runs)
        )
    assert checked >= 12  # ppl and ppl_sw at 16 and 64, val loss and ppl, per encoder


def test_report_lists_the_failures_and_draws(sweep: Path) -> None:
    rep = build_report(sweep)
    failed = sorted((f.dir.name, f.status, f.error) for f in rep.failures)
    message = "RuntimeError: deliberately broken encoder: embed() raises"
    assert failed == [
        ("2_lm_broken_seed0", "failed", message),
        ("3_lm_broken_seed1", "failed", message),
    ]
    md = (sweep / "report" / "report.md").read_text()
    assert "4 finished, 2 failed" in md
    assert f"| 2_lm_broken_seed0 | failed | lm | broken | 0 | {message} |" in md
    pngs = [p for p in rep.files if p.suffix == ".png"]
    assert {p.name for p in pngs} == {"lm_test_ppl_vs_length.png", "lm_test_loss_by_position.png"}
    assert all(p.stat().st_size > 1000 for p in pngs)


# ---------------------------------------------------------------------------------- launchers
def test_ddp_is_refused_inside_a_local_multirun() -> None:
    assert [run.local_processes(d) for d in (1, 2, "2", "auto", "0,1", [0, 1, 2], -1)] == [
        1,
        2,
        2,
        1,
        2,
        3,
        2,
    ]
    cfg = OmegaConf.create({"trainer": {"devices": 2}})
    with pytest.raises(ValueError, match="trainer.devices=2 in a local multirun"):
        run.check_ddp_in_multirun(cfg)
    run.check_ddp_in_multirun(OmegaConf.create({"trainer": {"devices": 1}}))


def test_ddp_guard_counts_gpus_with_lightnings_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a node with 4 GPUs, ``devices=auto`` (and -1) is four processes, not one."""
    from pytorch_lightning.accelerators import CUDAAccelerator

    monkeypatch.setattr(CUDAAccelerator, "is_available", staticmethod(lambda: True))
    monkeypatch.setattr(CUDAAccelerator, "auto_device_count", staticmethod(lambda: 4))
    monkeypatch.setattr(
        CUDAAccelerator,
        "parse_devices",
        staticmethod(lambda d: [0, 1, 2, 3] if str(d) == "-1" else [0, 1]),
    )
    assert run.local_processes("auto") == run.local_processes(-1, "gpu") == 4
    assert run.local_processes("0,1", "cuda") == 2
    assert run.local_processes(2, "cpu") == 2
    cfg = OmegaConf.create({"trainer": {"devices": "auto", "accelerator": "auto"}})
    with pytest.raises(ValueError, match="trainer.devices=auto in a local multirun"):
        run.check_ddp_in_multirun(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_a_gpu_sweep_on_a_machine_without_one_leaves_the_refusal_to_each_job() -> None:
    """Lightning's device parser raised, in the sweep job, before the job's checks could
    say in one line that there is no GPU here (a traceback in every error.json)."""
    assert run.local_processes(1, "gpu") == 0
    run.check_ddp_in_multirun(OmegaConf.create({"trainer": {"devices": 2, "accelerator": "gpu"}}))


def test_local_parallel_launcher_config() -> None:
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    launcher = instantiate(compose_hydra("hydra/launcher=local_parallel").hydra.launcher)
    assert type(launcher).__name__ == "JoblibLauncher"  # the plugin is found and composes


def test_slurm_launcher_renders_one_task_per_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin's own parameter mapping and submitit's sbatch file, without a cluster."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    (tmp_path / "srun").write_text("#!/bin/sh\n")  # submitit looks for srun on PATH
    (tmp_path / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    cfg = compose_hydra(
        "hydra/launcher=slurm",
        "hydra.launcher.partition=gpu",
        "trainer.devices=4",
        "trainer.strategy=ddp",
        "trainer.num_nodes=2",
        f"hydra.sweep.dir={tmp_path}",
    )
    params = dict(instantiate(cfg.hydra.launcher).params)
    # As SlurmLauncher.launch maps them (hydra_submitit_launcher 1.2).
    executor = submitit.AutoExecutor(
        cluster="slurm",
        folder=params.pop("submitit_folder"),
        slurm_max_num_timeout=params.pop("max_num_timeout"),
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    sbatch = executor._executor._make_submission_file_text("python run.py", "0")
    for line in (
        "--ntasks-per-node=4",
        "--gpus-per-node=4",
        "--nodes=2",
        "--partition=gpu",
        "--time=240",
        "--cpus-per-task=8",
        "--mem=32GB",
    ):
        assert f"#SBATCH {line}\n" in sbatch, line


def test_a_multirun_from_an_empty_folder_makes_its_own_sweep_dir(tmp_path: Path) -> None:
    """``python run.py -m ...`` as the README prints it, without ``hydra.sweep.dir``, from
    an empty folder: the sweep directory comes from conf/config.yaml (it failed with
    "HydraConfig was not set"), and two sweeps started together keep their own (#38).
    T5: the sweep's check builds its bucket table with a parallel op before the job is
    forked, and a job forked after OpenMP's pool had started waited forever."""
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "sweep=smoke",
        "encoder=t5",
        "seed=0",
        f"paths.cache_dir={tmp_path / 'cache'}",
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "sweep finished: 1 of 1 jobs have results" in out
    sweeps = sorted((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 2 and all(s.name.startswith("smoke_") for s in sweeps), sweeps
    for s in sweeps:
        assert [p.parent.name for p in s.glob("*/metrics.json")] == ["0_lm_t5_seed0"]


# ------------------------------------------------------------------------- checked before launch
def run_sweep(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``python run.py -m <overrides>`` from ``tmp_path``, its sweep and cache there."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "-m",
            *overrides,
            f"hydra.sweep.dir={tmp_path / 'multirun'}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ------------------------------------------------------------------------------ on a full disk
def _fill_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a new file is created but nothing fits in it (ENOSPC), as on a full disk."""

    def write_text(self: Path, *args: object, **kwargs: object) -> int:
        self.touch()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", write_text)


def _checkpoint_error(path: Path) -> CheckpointError:
    """The error a job raises when its checkpoint finds the disk full."""
    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError as full:
            raise CheckpointError(f"could not write checkpoint {path}: full") from full
    except CheckpointError as err:
        return err


def test_a_full_disk_is_named_in_error_json_written_into_the_space_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(The job's error.json failed with an OSError traceback, an empty .tmp file stayed,
    and the sweep recorded "JobKilled: ... exit status 1".)"""
    ckpt = tmp_path / "checkpoints" / "best.ckpt"
    with multirun_config("encoder=rope", "seed=0,1"), space_for_error_record(tmp_path):
        _fill_disk(monkeypatch)
        path = run.record_failure(_checkpoint_error(ckpt), tmp_path, 1)
    assert path == tmp_path / "error.json"
    assert os.listdir(tmp_path) == ["error.json"]
    record = json.loads(path.read_text())
    assert record["error_type"] == "CheckpointError"
    assert record["write_failure"] == f"no space left on device: {ckpt}"
    assert (record["encoder"], record["seed"]) == ("rope", 1)
    assert "OSError: [Errno 28] No space left on device" in record["traceback"]


def test_a_failure_that_cannot_be_recorded_is_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A disk full before the job held any space back: no error.json, no exception (the
    job's process ended on it before), no temporary file; the log says why."""
    with multirun_config("encoder=rope", "seed=0,1"):
        _fill_disk(monkeypatch)
        assert run.record_failure(_checkpoint_error(tmp_path / "last.ckpt"), tmp_path, 0) is None
    assert os.listdir(tmp_path) == []
    assert (
        f"could not record this job's failure in {tmp_path / 'error.json'} (no space left on "
        f"device: {tmp_path}/.error.json.tmp" in caplog.text
    )


FULL_DISK = """
import errno, os, pathlib, runpy, sys
import torch
full = []
def _enospc(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
def save(obj, f, *args, **kwargs):  # the disk fills up during the first checkpoint
    full.append(f)
    raise _enospc(f)
write_text = pathlib.Path.write_text
def write_text_when_full(self, *args, **kwargs):
    if full:  # a new file is created, then nothing fits in it
        self.touch()
        raise _enospc(self)
    return write_text(self, *args, **kwargs)
torch.save = save
pathlib.Path.write_text = write_text_when_full
sys.argv[0] = "run.py"
sys.path.insert(0, os.getcwd())  # this checkout's posenc, as `python run.py` imports it
runpy.run_path("run.py", run_name="__main__")
"""


def test_a_sweep_on_a_full_disk_records_each_job_as_no_space_left(tmp_path: Path) -> None:
    """``python run.py -m encoder=rope seed=0,1`` whose disk fills up at the first
    checkpoint (torch.save and every later new file fail with ENOSPC, in a wrapper that
    then runs run.py): each job's error.json names the checkpoint error and "no space left
    on device", no traceback, no JobKilled, no temporary file; the sweep's summary counts
    the jobs by that cause and prints the command that continues the sweep."""
    from tests.conftest import TINY

    wrapper = tmp_path / "full_disk.py"
    wrapper.write_text(FULL_DISK)
    out = tmp_path / "multirun"
    proc = subprocess.run(
        [
            sys.executable,
            str(wrapper),
            "-m",
            *TINY,
            "encoder=rope",
            "seed=0,1",
            f"hydra.sweep.dir={out}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert "Traceback" not in said and "JobKilled" not in said, said[-3000:]
    for job in ("0_lm_rope_seed0", "1_lm_rope_seed1"):
        folder = out / job
        record = json.loads((folder / "error.json").read_text())
        assert record["error_type"] == "CheckpointError", record
        assert record["write_failure"].startswith(
            f"no space left on device: {folder / 'checkpoints'}/"
        ), record
        assert not [p.name for p in folder.rglob(".*") if p.is_file()], "temporary files left"
    assert "sweep finished: 0 of 2 jobs have results, 2 failed" in proc.stdout
    assert (
        "2 of the failed jobs could not write their files: no space left on device. Make "
        "room (or fix the folder), then continue the sweep with:\n  python run.py -m "
    ) in proc.stdout, proc.stdout
    assert f"hydra.sweep.dir={out} resume=true" in proc.stdout


def test_sweep_jobs_are_the_jobs_hydra_launches_in_its_order() -> None:
    """The grid the check walks is the basic sweeper's: the preset's params, then the
    command line (which wins), the last key varying fastest; checked against the job
    directories a real sweep made (sweep=lr_tune: each encoder's three rates in a row)."""
    with multirun_config("sweep=lr_tune", "encoder=rope,alibi") as cfg:
        jobs = run.sweep_jobs(cfg)
    assert [" ".join(j) for j in jobs][:4] == [
        "task=lm seed=0 encoder=rope task.optim.lr=0.0003 sweep=lr_tune",
        "task=lm seed=0 encoder=rope task.optim.lr=0.001 sweep=lr_tune",
        "task=lm seed=0 encoder=rope task.optim.lr=0.003 sweep=lr_tune",
        "task=lm seed=0 encoder=alibi task.optim.lr=0.0003 sweep=lr_tune",
    ]
    assert len(jobs) == 6
    with multirun_config("sweep=lm_extrapolation") as cfg:
        assert len(run.sweep_jobs(cfg)) == 11 * 3


def test_a_sweep_with_a_refused_job_starts_none_and_says_which(tmp_path: Path) -> None:
    """``encoder=learned,rope task.seq_len=2000``: the learned table has 1024 rows, so its
    jobs would be refused. The sweep stops before any job, in one message naming those
    jobs (the seeds of one combination together) and the problem, with exit status 2 and
    no traceback; nothing is written."""
    out = tmp_path / "multirun"
    proc = run_sweep(tmp_path, "encoder=rope,learned", "seed=0,1", "task.seq_len=2000")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "error: 2 of 4 jobs of this sweep would be refused; none was started:",
        "  encoder=learned seed=0; encoder=learned seed=1:",
        "    task.seq_len=2000: longer than encoder.max_len=1024; raise encoder.max_len or "
        "lower task.seq_len",
        "Fix those values, or leave those combinations out of the sweep.",
    ]
    assert not out.exists() and not (tmp_path / "outputs").exists()


def test_the_sweep_check_applies_tuned_rates_and_names_every_problem(tmp_path: Path) -> None:
    """``+tuned`` is applied per job before the checks (a file without one of the sweep's
    encoders refuses that encoder's jobs), and a problem every job shares is said once."""
    from posenc.tuned import write

    write(
        tmp_path / "tuned_lr.yaml",
        {"lm": {"criterion": "val/loss", "grid": [1e-3], "lr": {"rope": 1e-3}, "at_edge": []}},
        tmp_path,
    )
    with multirun_config("encoder=rope,alibi", f"+tuned={tmp_path}", "model.n_heads=3") as cfg:
        refused = dict(run.sweep_problems(cfg))
    assert list(refused) == ["encoder=rope", "encoder=alibi"]
    assert refused["encoder=rope"] == ["model.n_heads=3: must divide model.d_model=128"]
    assert refused["encoder=alibi"][0].startswith(
        f"tuned={tmp_path}: no tuned learning rate for encoder 'alibi' on task lm"
    )
    with multirun_config("encoder=rope,alibi", f"+tuned={tmp_path}", "seed=3") as cfg:
        assert dict(run.sweep_problems(cfg)).keys() == {"encoder=alibi"}


def test_the_sweep_check_refuses_a_rate_chosen_from_an_incomplete_grid(tmp_path: Path) -> None:
    """rope's rate was chosen while its runs at 3e-3 failed: its jobs are refused before
    the sweep starts, unless +tuned_allow_partial=true; alibi's complete choice passes."""
    from posenc.tuned import write

    entry = {"grid": [1e-3, 3e-3], "lr": {"rope": 1e-3, "alibi": 3e-3}}
    entry |= {"chosen_from": {"rope": [1e-3], "alibi": [1e-3, 3e-3]}}
    write(tmp_path / "tuned_lr.yaml", {"lm": entry | {"failed": {"rope": [3e-3]}}}, tmp_path)
    with multirun_config("encoder=rope,alibi", f"+tuned={tmp_path}") as cfg:
        refused = dict(run.sweep_problems(cfg))
    assert refused == {
        "encoder=rope": [
            f"tuned={tmp_path}: rope's rate 0.001 on task lm was chosen from an incomplete "
            f"grid (only 0.001 have results; runs at 0.003 failed); rerun the failed jobs "
            f"and the report, or add +tuned_allow_partial=true to take it anyway"
        ]
    }
    allowed = ("encoder=rope,alibi", f"+tuned={tmp_path}", "+tuned_allow_partial=true")
    with multirun_config(*allowed) as cfg:
        assert run.sweep_problems(cfg) == []


def test_the_sweep_check_reads_overrides_as_the_sweeper_does(tmp_path: Path) -> None:
    """A ``glob()`` sweep is expanded (it was skipped), an interpolation is resolved in each
    job's own config (learned's ``max_len`` is 1024, so its seq_len is 1024, not the
    fallback 2000), and only the jobs of the negative seed carry its problem."""
    proc = run_sweep(
        tmp_path,
        "+variant=glob(learned*)",
        "task.seq_len=${oc.select:encoder.max_len,2000}",
        "seed=0,-1",
        "trainer.max_steps=1",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    random = (
        "model.random_positions=128: smaller than task.seq_len=1024; it must be at least "
        "the longest training sequence (e.g. 8-16x task.seq_len)"
    )
    assert proc.stderr.strip().splitlines() == [
        "error: 3 of 4 jobs of this sweep would be refused; none was started:",
        "  +variant=learned seed=-1:",
        "    seed=-1: must be an integer >= 0",
        "  +variant=learned_rand seed=0:",
        f"    {random}",
        "  +variant=learned_rand seed=-1:",
        "    seed=-1: must be an integer >= 0",
        f"    {random}",
        "Fix those values, or leave those combinations out of the sweep.",
    ]


def test_the_sweep_check_leaves_machine_checks_to_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before launch nothing asks torch about CUDA (in the process that forks the jobs it
    would break CUDA in each of them) and no cache folder is made: an algorithmic sweep's
    memory check and the cache check run in the jobs, on their own machines."""
    import torch

    def no_cuda_query() -> bool:
        raise AssertionError("torch.cuda.is_available() called before the jobs start")

    monkeypatch.setattr(torch.cuda, "is_available", no_cuda_query)
    cache = tmp_path / "not_made"
    with multirun_config(
        "sweep=algo_length", "encoder=rope,alibi", f"paths.cache_dir={cache}"
    ) as cfg:
        assert run.sweep_problems(cfg) == []
    assert not cache.exists()


def test_the_sweep_check_composes_each_job_as_its_launcher_does() -> None:
    """The check composes each choice of groups once and applies each job's values to a
    copy: every job's config equals Hydra's own composition of it (``load_sweep_config``,
    as a launcher makes it), and ``${hydra:...}`` reads that job's choices. The grid mixes
    groups (``+variant``) and values, one of them an interpolation."""
    from hydra.core.global_hydra import GlobalHydra

    overrides = (
        "sweep=algo_content",
        "+variant=rope,learned_rand",
        "experiment=algo_count,algo_flipflop",
        "task.test_per_size=8,${task.val_per_size}",
        "seed=0,1",
        "+label=${hydra:runtime.choices.encoder}",
    )
    with multirun_config(*overrides) as cfg:
        jobs = run.sweep_jobs(cfg)
        assert len(jobs) == 16
        loader = GlobalHydra.instance().config_loader()
        for job, mine in run.job_configs(cfg, jobs):
            assert mine is not None
            theirs = loader.load_sweep_config(cfg, list(job))
            with open_dict(theirs):
                del theirs["hydra"]
            assert OmegaConf.to_yaml(mine) == OmegaConf.to_yaml(theirs), job
            encoder = next(o for o in job if o.startswith("+variant=")).split("=")[1]
            assert mine.label == encoder.removesuffix("_rand"), job
        declined = [c for _, c in run.job_configs(cfg, jobs, lambda i: i % 2 == 0)]
        assert [c is None for c in declined] == [i % 2 == 1 for i in range(16)]


def test_a_pool_of_no_workers_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hydra.launcher.n_jobs=0`` (joblib's ValueError with a traceback, after the sweep
    had started) is refused before any job, saying what the value means."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    overrides = ("encoder=rope,alibi", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=0")
    with (
        multirun_config(*overrides, f"hydra.sweep.dir={tmp_path}") as cfg,
        pytest.raises(SystemExit) as stopped,
    ):
        run.SweepCheck().on_multirun_start(cfg)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == (
        "error: hydra.launcher.n_jobs=0: must be the number of jobs to run at a time (a "
        "positive integer), or -1 for one per core\n"
    )
