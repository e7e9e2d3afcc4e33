"""+tuned=<report dir>: each run takes its encoder's tuned learning rate from the file the
report writes, records where it came from, and bad input fails in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from posenc import tuned
from posenc.config import ConfigError
from posenc.train import train
from tests.conftest import compose_run, run_py


def _tuned_dir(tmp_path: Path, tasks: dict | None = None) -> Path:
    """A report directory with a tuned_lr.yaml as the report writes it."""
    d = tmp_path / "report"
    d.mkdir(parents=True, exist_ok=True)
    tasks = tasks or {
        "lm": {
            "criterion": "val/loss",
            "grid": [1e-3, 3e-3],
            "lr": {"rope": 3e-3, "alibi": 1e-3},
            "at_edge": ["rope"],
        }
    }
    tuned.write(d / tuned.FILE, tasks, tmp_path / "sweep")
    return d


def test_a_run_takes_its_encoders_rate_and_records_where_from(tmp_path: Path) -> None:
    d = _tuned_dir(tmp_path)
    result = train(
        compose_run(tmp_path, "encoder=rope", f"+tuned={d}", "task.eval.multipliers=[1]")
    )
    config = result["config"]
    assert config["task"]["optim"]["lr"] == 3e-3
    assert config["tuned"] == {
        "file": str((d / tuned.FILE).resolve()),
        "task": "lm",
        "encoder": "rope",
        "lr": 3e-3,
    }
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["config"]["tuned"]["lr"] == 3e-3
    # The file itself works as well as its directory.
    cfg = compose_run(tmp_path, "encoder=alibi", f"+tuned={d / tuned.FILE}")
    tuned.apply(cfg)
    assert cfg.task.optim.lr == 1e-3 and cfg.tuned.encoder == "alibi"


def test_algo_runs_on_random_positions_are_keyed_as_the_report_names_them(
    tmp_path: Path,
) -> None:
    from tests.tasks.test_algo_job import _compose

    d = _tuned_dir(tmp_path, {"algo_copy": {"lr": {"rope": 1e-3, "rope_rand": 3e-4}}})
    cfg = _compose(tmp_path, "encoder=rope", "model.random_positions=64", f"+tuned={d}")
    tuned.apply(cfg)
    assert (cfg.task.optim.lr, cfg.tuned.encoder, cfg.tuned.task) == (
        3e-4,
        "rope_rand",
        "algo_copy",
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "nope", "no such file or directory"),
        (lambda p: p, "no tuned_lr.yaml in that directory; make one with python -m posenc.report"),
        (lambda p: _write(p, "a: [1, 2\n"), "not a posenc tuned-lr file (unreadable"),
        (lambda p: _write(p, "format: other\n"), "(expected format: posenc-tuned-lr/1)"),
        (
            lambda p: _write(p, f"format: {tuned.FORMAT}\ntasks: {{lm: {{lr: {{rope: -1}}}}}}\n"),
            "tasks.lm.lr.rope=-1 is not a positive number",
        ),
    ],
)
def test_missing_or_malformed_files_are_one_line_errors(tmp_path: Path, make, message) -> None:
    source = make(tmp_path)
    with pytest.raises(ConfigError) as err:
        tuned.apply(compose_run(tmp_path, "encoder=rope", f"+tuned={source}"))
    assert message in str(err.value) and "\n" not in str(err.value)


def _write(d: Path, text: str) -> Path:
    (d / tuned.FILE).write_text(text)
    return d


def test_an_encoder_or_task_not_in_the_file_is_refused(tmp_path: Path) -> None:
    d = _tuned_dir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"no tuned learning rate for encoder 'xl' on task "
        r"lm \(tuned: rope, alibi\)",
    ):
        tuned.apply(compose_run(tmp_path, "encoder=xl", f"+tuned={d}"))
    with pytest.raises(
        ConfigError,
        match=r"no tuned learning rates for task algo_copy \(the "
        r"file has lm\)",
    ):
        from tests.tasks.test_algo_job import _compose

        tuned.apply(_compose(tmp_path, "encoder=rope", f"+tuned={d}"))


def _partial_dir(tmp_path: Path) -> Path:
    """A report directory whose rope rate was chosen while its runs at 3e-3 failed."""
    entry = {"grid": [3e-4, 1e-3, 3e-3], "lr": {"rope": 1e-3, "alibi": 3e-3}}
    entry |= {"chosen_from": {"rope": [3e-4, 1e-3], "alibi": [3e-4, 1e-3, 3e-3]}}
    entry |= {"failed": {"rope": [3e-3], "alibi": []}}
    return _tuned_dir(tmp_path, {"lm": entry})


def test_a_rate_chosen_from_an_incomplete_grid_is_refused_unless_allowed(
    tmp_path: Path,
) -> None:
    d = _partial_dir(tmp_path)
    with pytest.raises(ConfigError) as err:
        tuned.apply(compose_run(tmp_path, "encoder=rope", f"+tuned={d}"))
    assert str(err.value) == (
        f"tuned={d}: rope's rate 0.001 on task lm was chosen from an incomplete grid (only "
        f"0.0003, 0.001 have results; runs at 0.003 failed); rerun the failed jobs and the "
        f"report, or add +tuned_allow_partial=true to take it anyway"
    )
    cfg = compose_run(tmp_path, "encoder=rope", f"+tuned={d}", "+tuned_allow_partial=true")
    tuned.apply(cfg)
    assert cfg.task.optim.lr == 1e-3
    cfg = compose_run(tmp_path, "encoder=alibi", f"+tuned={d}")  # complete: no question
    tuned.apply(cfg)
    assert cfg.task.optim.lr == 3e-3
    with pytest.raises(ConfigError, match=r"^tuned_allow_partial='yes': must be true or false"):
        tuned.apply(
            compose_run(tmp_path, "encoder=rope", f"+tuned={d}", "+tuned_allow_partial=yes")
        )


def test_a_file_from_before_the_record_of_failures_loads_with_a_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = _tuned_dir(tmp_path)  # no failed / chosen_from: as the report wrote it before
    assert tuned.load(d / tuned.FILE).failed == {}
    cfg = compose_run(tmp_path, "encoder=rope", f"+tuned={d}")
    with caplog.at_level("WARNING", logger="posenc.tuned"):
        tuned.apply(cfg)
        tuned.apply(compose_run(tmp_path, "encoder=alibi", f"+tuned={d}"))
    assert cfg.task.optim.lr == 3e-3
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        f"{(d / tuned.FILE).resolve()} predates the record of failed rates: its choices are "
        f"taken as made from complete grids (python -m posenc.report on the sweep rewrites it)"
    ]  # once per file, not once per run


def test_run_py_refuses_a_partial_choice_in_one_line_before_training(tmp_path: Path) -> None:
    d = _partial_dir(tmp_path)
    proc = run_py(tmp_path, "encoder=rope", f"+tuned={d}")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(f"error: tuned={d}: rope's rate 0.001 on task lm")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained


def test_a_resumed_runs_record_must_match_its_lr(tmp_path: Path) -> None:
    cfg = compose_run(
        tmp_path,
        "encoder=rope",
        "task.optim.lr=0.003",
        "+tuned={file:/x,task:lm,encoder:rope,lr:0.003}",
    )
    tuned.apply(cfg)  # a record (from a resumed run's config) is left as it is
    assert OmegaConf.to_container(cfg.tuned)["lr"] == 0.003
    cfg.task.optim.lr = 0.001
    with pytest.raises(ConfigError, match="tuned.lr=0.003 but task.optim.lr=0.001"):
        tuned.apply(cfg)


def test_an_evaluation_counts_as_tuned_only_if_the_model_was_trained_at_the_rate(
    tmp_path: Path,
) -> None:
    """eval_only with +tuned: a model trained at its scheme's tuned rate (here without
    +tuned, as a tuning sweep trains it) is recorded as tuned, so the report puts it in
    the tuned-lr table; one trained at another rate is not (its record would be false)."""
    trained = train(compose_run(tmp_path / "a", "encoder=rope", "task.optim.lr=0.003"))
    assert trained["config"].get("tuned") is None
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "best.ckpt"

    def evaluate(where: str, rates: dict[str, float]) -> dict:
        d = _tuned_dir(tmp_path / where, {"lm": {"criterion": "val/loss", "lr": rates}})
        args = ["encoder=rope", f"+tuned={d}", "eval_only=true", f"ckpt_path={ckpt}"]
        return train(compose_run(tmp_path / where, *args))["config"]

    assert evaluate("b", {"rope": 0.003})["tuned"] == {
        "file": str((tmp_path / "b" / "report" / tuned.FILE).resolve()),
        "task": "lm",
        "encoder": "rope",
        "lr": 0.003,
    }
    other = evaluate("c", {"rope": 0.01})
    assert other["tuned"] is None and other["task"]["optim"]["lr"] == 0.003


def test_run_py_refuses_a_bad_file_before_the_sweep_starts(tmp_path: Path) -> None:
    proc = run_py(tmp_path, "-m", "encoder=rope,alibi", f"+tuned={tmp_path / 'missing'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: tuned={tmp_path / 'missing'}: no such file or "
        f"directory; give the report directory that holds "
        f"tuned_lr.yaml, or the file itself (make one with python "
        f"-m posenc.report <dir of a sweep with an lr grid, "
        f"sweep=lr_tune>)"
    )
    assert not (tmp_path / "outputs").exists()  # no job started


def test_a_learning_rate_given_with_tuned_is_refused_as_a_contradiction(tmp_path: Path) -> None:
    """``task.optim.lr`` on the command line and ``+tuned`` both set the rate: one of the
    two would be ignored without a word (``+tuned`` overwrote the given rate), so the
    pair is refused in one line naming both and how to keep either; a rate a preset sets
    is what ``+tuned`` replaces, and a run that gives none takes its tuned rate."""
    d = _tuned_dir(tmp_path)
    cfg = compose_run(tmp_path, "encoder=rope", f"+tuned={d}", "task.optim.lr=0.01")
    with pytest.raises(ConfigError) as err:
        tuned.apply(cfg, {"encoder._target_", "tuned", "task.optim.lr"})
    assert str(err.value) == (
        f"tuned={d} and task.optim.lr=0.01 both set the learning rate; drop task.optim.lr "
        f"to train each scheme at its tuned rate, or drop +tuned to train at 0.01"
    )
    tuned.apply(cfg, {"encoder._target_", "tuned"})  # the same value from a preset
    assert cfg.task.optim.lr == 3e-3


@pytest.mark.parametrize("sweep", [False, True])
def test_run_py_refuses_a_learning_rate_given_with_tuned_before_training(
    tmp_path: Path, sweep: bool
) -> None:
    d = _tuned_dir(tmp_path)
    args = ["-m", "encoder=rope,alibi", "task.optim.lr=1e-3,3e-3"] if sweep else ["encoder=rope"]
    proc = run_py(tmp_path, *args, f"+tuned={d}", *([] if sweep else ["task.optim.lr=0.01"]))
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = proc.stderr.strip()
    if sweep:  # the sweep check names each refused job before any starts
        assert said.count("both set the learning rate") == 2, said
        assert f"tuned={d} and task.optim.lr=0.003 both set the learning rate" in said
    else:
        assert said == (
            f"error: tuned={d} and task.optim.lr=0.01 both set the learning rate; drop "
            f"task.optim.lr to train each scheme at its tuned rate, or drop +tuned to train "
            f"at 0.01"
        )
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained
