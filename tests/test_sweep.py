"""The smoke sweep for real (one job deliberately broken), its report, and the launchers."""

from __future__ import annotations

import contextlib
import csv
import errno
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor

from posenc import cli as run
from posenc.config import validate
from posenc.encoders.none import NoPositions
from posenc.errors import CheckpointError
from posenc.report import build_report
from posenc.training.rundir import space_for_error_record
from tests.conftest import ENCODER_YAMLS, ROOT, VARIANT_YAMLS


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


# ----------------------------------------------------------------------------- presets, launchers
def compose_hydra(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "sweep").glob("*.yaml")))
def test_sweep_presets(preset: str, tmp_path: Path) -> None:
    """Every job of a preset's grid (first seed) composes and passes the config checks,
    so a preset cannot hold a job that is refused (a causal-only scheme in translation,
    an encoder without a YAML). The arms are encoders, or variants (conf/variant/: an
    encoder, possibly trained on randomized positions)."""
    params = OmegaConf.to_container(compose_hydra(f"sweep={preset}").hydra.sweeper.params)
    arm = "encoder" if "encoder" in params else "+variant"
    grid = str(params[arm]).split(",")
    known = ENCODER_YAMLS if arm == "encoder" else VARIANT_YAMLS
    assert len(set(grid)) == len(grid) and set(grid) <= set(known), grid
    axes = {key: str(values).split(",") for key, values in params.items() if key != "seed"}
    first_seed = [f"seed={str(params['seed']).split(',')[0]}"] if "seed" in params else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for values in itertools.product(*axes.values()):
            job = [f"{key}={value}" for key, value in zip(axes, values, strict=True)]
            validate(
                compose(
                    "config",
                    overrides=[
                        f"sweep={preset}",
                        *job,
                        *first_seed,
                        f"paths.output_dir={tmp_path}",
                        f"paths.cache_dir={tmp_path}",
                    ],
                )
            )


#: Variants that set an encoder option (name: encoder, the options it sets).
#: Variants that set options: name -> (encoder, its options, model options, label).
OPTION_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any], str | None]] = {
    "stickbreak_value": ("stickbreak", {"remainder": "value"}, {}, None),
    "rope_nope4": ("mix", {"layers": ["rope", "rope", "rope", "none"]}, {}, "rope_nope4"),
    "nope_rope4": ("mix", {"layers": ["none", "none", "none", "rope"]}, {}, "nope_rope4"),
    "rope_none_heads": ("mix", {"heads": ["rope", "none"]}, {}, "rope_none_heads"),
    "prope75": ("rope", {"p": 0.75}, {}, "prope75"),
    "rope_qknorm": ("rope", {}, {"qk_norm": True}, "rope_qknorm"),
    "none_ssmax": ("none", {}, {"logit_scale": "ssmax"}, "none_ssmax"),
    "rope_sinks": ("rope", {}, {"sinks": True}, "rope_sinks"),
    "alibi_dape": ("dape", {"base": "alibi"}, {}, "alibi_dape"),
    "kerple_dape": ("dape", {"base": "kerple"}, {}, "kerple_dape"),
}


def test_every_encoder_is_a_variant_and_rand_variants_randomize() -> None:
    """conf/variant/<encoder>.yaml selects that encoder and nothing else; <e>_rand.yaml
    selects e and trains it on randomized positions; an option variant selects its
    encoder with those options and model options (a plain variant leaves both at their
    defaults) and names its label, which a plain variant leaves unset."""
    assert set(ENCODER_YAMLS) <= set(VARIANT_YAMLS)
    model = compose_hydra().model
    for name in VARIANT_YAMLS:
        cfg = compose_hydra(f"+variant={name}")
        default = (name.removesuffix("_rand"), {}, {}, None)
        base, options, model_options, label = OPTION_VARIANTS.get(name, default)
        assert cfg.hydra.runtime.choices.encoder == base
        assert (cfg.model.random_positions is not None) == name.endswith("_rand"), name
        plain = compose_hydra(f"encoder={base}").encoder
        assert {k: cfg.encoder[k] for k in options} == options, name
        assert {k: v for k, v in cfg.encoder.items() if k not in options} == {
            k: v for k, v in plain.items() if k not in options
        }, name
        mine = {k: v for k, v in cfg.model.items() if k != "random_positions"}
        assert mine == {
            k: model_options.get(k, v) for k, v in model.items() if k != "random_positions"
        }, name
        assert cfg.label == label, name
    assert compose_hydra("+variant=stickbreak").encoder.remainder == "head_bias"


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


def _children(pid: int) -> list[int]:
    try:
        return [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


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
        jobs = [g for c in _children(proc.pid) for g in _children(c)]
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


def test_a_multirun_from_an_empty_folder_makes_its_own_sweep_dir(tmp_path: Path) -> None:
    """``python run.py -m ...`` as the README prints it, without ``hydra.sweep.dir``, from
    an empty folder: the sweep directory comes from conf/config.yaml (it failed with
    "HydraConfig was not set"), and two sweeps started together keep their own (#38)."""
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        "-m",
        "sweep=smoke",
        "encoder=none",
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
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "sweep finished: 1 of 1 jobs have results" in out
    sweeps = sorted((tmp_path / "outputs" / "multirun").iterdir())
    assert len(sweeps) == 2 and all(s.name.startswith("smoke_") for s in sweeps), sweeps
    for s in sweeps:
        assert [p.parent.name for p in s.glob("*/metrics.json")] == ["0_lm_none_seed0"]


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
    family = list(_children(pid))
    return family + [g for c in family for g in _children(c)]


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


@pytest.mark.parametrize("preset", ["mt_length", "algo_content"])
def test_a_presets_task_takes_the_task_keys_of_the_command_line(preset: str) -> None:
    """A preset of one task selects it for the whole sweep, so the command line may set
    that task's keys (``sweep=mt_length tokenizer.vocab_size=400`` was refused as a key
    not in the LM task's config)."""
    overrides = {
        "mt_length": ["tokenizer.vocab_size=400", "task.max_len=64"],
        "algo_content": ["task.test_per_size=8"],
    }[preset]
    cfg = compose_hydra(f"sweep={preset}", *overrides)
    for o in overrides:
        key, _, value = o.partition("=")
        assert str(OmegaConf.select(cfg, key)) == value


# ------------------------------------------------------------------------- checked before launch
@contextlib.contextmanager
def multirun_config(*overrides: str) -> Iterator[DictConfig]:
    """The config of ``python run.py -m <overrides>`` as a sweep's callbacks see it (its
    command line in ``hydra.overrides.task``), with Hydra initialized."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        plain = [o for o in overrides if "," not in o]
        cfg = compose("config", overrides=plain, return_hydra_config=True)
        with open_dict(cfg):
            cfg.hydra.overrides.task = list(overrides)
        HydraConfig.instance().set_config(cfg)
        try:
            yield cfg
        finally:
            HydraConfig.instance().cfg = None  # later tests run outside Hydra


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
