"""run.py's command line checked before Hydra starts: an unknown group option with the
nearest one, a launcher whose plugin is missing with the install line, and resume=true
without the folder to resume, each one line and exit status 2."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posenc import preflight
from tests.conftest import ROOT, run_py

CONF = ROOT / "conf"
ENCODERS = ", ".join(preflight.group_options(CONF, "encoder"))


def test_an_unknown_group_option_gets_the_nearest_one() -> None:
    assert preflight.unknown_options(["encoder=rpoe", "task=lm", "seed=1"], CONF) == [
        f"encoder=rpoe: no such option; did you mean encoder=rope? allowed: {ENCODERS}"
    ]
    # each value of a sweep; a glob, null and the options that exist pass
    assert preflight.unknown_options(["encoder=rope,alibii", "+variant=glob(*)"], CONF) == [
        f"encoder=alibii: no such option; did you mean encoder=alibi? allowed: {ENCODERS}"
    ]
    assert preflight.unknown_options(["task=mt", "experiment=null", "sweep=smoke"], CONF) == []
    assert preflight.unknown_options(["data=zzzz"], CONF) == [
        "data=zzzz: no such option; allowed: "
        + ", ".join(p.stem for p in sorted((CONF / "data").glob("*.yaml")))
    ]
    # the launcher: this project's files and those Hydra and its plugins bring
    launchers = "basic, joblib, local_parallel, slurm, submitit_local, submitit_slurm"
    assert preflight.unknown_options(["hydra/launcher=local_paralel"], CONF) == [
        "hydra/launcher=local_paralel: no such option; did you mean "
        f"hydra/launcher=local_parallel? allowed: {launchers}"
    ]
    for name in launchers.split(", "):
        assert preflight.unknown_options([f"hydra/launcher={name}"], CONF) == []


def test_options_of_a_search_path_folder_count(tmp_path: Path) -> None:
    """``hydra.searchpath=[file://<dir>]`` adds that folder's options (a test's or a
    user's own encoder); a search path that cannot be listed leaves the check to Hydra."""
    (tmp_path / "encoder").mkdir()
    (tmp_path / "encoder" / "mine.yaml").write_text("_target_: x.Y\n")
    path = f"hydra.searchpath=[file://{tmp_path}]"
    assert preflight.unknown_options(["encoder=mine,rope", path], CONF) == []
    assert preflight.unknown_options(["encoder=mien", path], CONF) == [
        f"encoder=mien: no such option; did you mean encoder=mine? allowed: "
        f"{', '.join(sorted([*preflight.group_options(CONF, 'encoder'), 'mine']))}"
    ]
    assert preflight.unknown_options(["encoder=mine", "hydra.searchpath=[pkg://x]"], CONF) == []


def test_run_py_says_an_unknown_option_in_one_line(tmp_path: Path) -> None:
    proc = run_py(tmp_path, "encoder=rpoe")
    assert proc.returncode == 2
    assert proc.stderr == (
        f"error: encoder=rpoe: no such option; did you mean encoder=rope? allowed: {ENCODERS}\n"
    )
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("encoder=rpoe", "error: encoder=rpoe: no such option; did you mean encoder=rope?"),
        ("model.d_modle=64", "error: model.d_modle: no such key; did you mean model.d_model?"),
        ("+tuned=nowhere", "error: tuned=nowhere: no such file or directory"),
    ],
)
def test_a_typo_is_refused_before_torch_is_imported(
    tmp_path: Path, override: str, line: str
) -> None:
    """The commonest typos cost a second, not the ten that importing torch and Lightning
    takes on a laptop: run.py checks group options, launchers, keys and the +tuned file
    before those imports (the schema and its allowed values do not need torch)."""
    code = (
        f"import atexit, runpy, sys; sys.path.insert(0, {str(ROOT)!r}); "
        "heavy = {'torch', 'pytorch_lightning'}; "
        "atexit.register(lambda: print(sorted(heavy & set(sys.modules)))); "
        f"sys.argv = ['run.py', {override!r}]; runpy.run_path({str(ROOT / 'run.py')!r}, "
        "run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(line), proc.stderr
    assert proc.stdout == "[]\n"


@pytest.mark.parametrize(("launcher", "extra"), [("local_parallel", "joblib"), ("slurm", "slurm")])
def test_a_launcher_without_its_plugin_names_the_install(
    monkeypatch: pytest.MonkeyPatch, launcher: str, extra: str
) -> None:
    assert preflight.missing_launcher([f"hydra/launcher={launcher}"]) == []  # installed here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    (line,) = preflight.missing_launcher(["-m", f"hydra/launcher={launcher}", "seed=0,1"])
    assert line.startswith(f"hydra/launcher={launcher} needs its Hydra plugin (hydra_plugins.")
    assert line.endswith(f'which is not installed: pip install -e ".[{extra}]" in the repository')


def _run_dir(outputs: Path, name: str, checkpoint: bool = True) -> Path:
    d = outputs / "lm" / "rope" / name
    (d / "checkpoints").mkdir(parents=True)
    if checkpoint:
        (d / "checkpoints" / "last.ckpt").write_bytes(b"x")
    return d


def test_resume_without_its_folder_names_the_newest_run_to_resume(tmp_path: Path) -> None:
    outputs = tmp_path / "outputs"

    def check(*args: str) -> list[str]:
        return preflight.resume_without_folder(list(args), CONF, outputs)

    assert check("resume=true") == [
        "resume=true needs the run's folder (hydra.run.dir=<run dir>), or it starts a new run "
        "in a new folder; no run of task=lm encoder=rope seed=0 with a last.ckpt is under "
        f"{outputs / 'lm' / 'rope'}: give hydra.run.dir, or drop resume=true to start afresh"
    ]
    _run_dir(outputs, "2026-01-01_10-00-00_seed0_aaaa")
    time.sleep(0.01)
    newest = _run_dir(outputs, "2026-01-02_10-00-00_seed0_bbbb")
    _run_dir(outputs, "2026-01-03_10-00-00_seed1_cccc")  # another seed
    _run_dir(outputs, "baby_gpt_2026-01-03_10-00-00_seed0_dddd")  # a preset's run
    _run_dir(outputs, "2026-01-04_10-00-00_seed0_eeee", checkpoint=False)  # nothing to resume
    assert check("encoder=rope", "resume=true") == [
        "resume=true needs the run's folder, or it starts a new run in a new folder: add "
        f"hydra.run.dir={newest} (the run of task=lm encoder=rope seed=0 with a last.ckpt; "
        "the newest of 2 such runs)"
    ]
    assert check("resume=true", f"hydra.run.dir={newest}") == []
    assert check("resume=false") == check("resume=true", "ckpt_path=/x.ckpt") == []
    sweep = outputs / "multirun" / "lr_tune_2026-01-01_10-00-00_abcd"
    sweep.mkdir(parents=True)
    assert check("-m", "sweep=lr_tune", "resume=true") == [
        "resume=true needs the sweep's folder, or it starts a new sweep in a new folder: add "
        f"hydra.sweep.dir={sweep} (the newest lr_tune under {outputs / 'multirun'})"
    ]
    assert check("-m", "resume=true", f"hydra.sweep.dir={sweep}") == []


@pytest.mark.parametrize(
    "flags",
    [
        ["--cfg", "job"],
        ["-c", "all"],
        ["--info"],
        ["--info=config"],
        ["--help"],
        ["-h"],
        ["--hydra-help"],
    ],
)
def test_resume_is_not_refused_where_hydra_only_prints(tmp_path: Path, flags: list[str]) -> None:
    """``--cfg job``, ``--help`` and the like print and start nothing: no folder needed."""
    outputs = tmp_path / "outputs"
    assert preflight.resume_without_folder(["resume=true"], CONF, outputs) != []
    assert preflight.resume_without_folder(["resume=true", *flags], CONF, outputs) == []
    sweep = ["-m", "sweep=lr_tune", "resume=true", *flags]
    assert preflight.resume_without_folder(sweep, CONF, outputs) == []


def test_run_py_prints_the_config_of_a_resume_without_its_folder(tmp_path: Path) -> None:
    proc = run_py(tmp_path, "resume=true", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "resume: true" in proc.stdout
    assert not (tmp_path / "outputs").exists()


def test_run_py_refuses_resume_without_its_folder_and_starts_nothing(tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "outputs", "2026-01-02_10-00-00_seed0_bbbb")
    proc = run_py(tmp_path, "resume=true")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: resume=true needs the run's folder")
    assert f"add hydra.run.dir=outputs/lm/rope/{run.name} (" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert [d.name for d in (tmp_path / "outputs" / "lm" / "rope").iterdir()] == [run.name]
