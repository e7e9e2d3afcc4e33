"""What a run prints when it ends, plain progress lines in log files, the preset's name
in its run directory, threads=N, and final metrics logged once in TensorBoard (#25)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posenc.results import from_json
from posenc.train import train
from posenc.training.summary import summary, sweep_lines
from tests.conftest import ROOT, compose_run


def test_lm_summary_is_a_table_of_the_metrics(tmp_path: Path) -> None:
    result = {
        "task": "lm",
        "encoder": "rope",
        "seed": 1,
        "seq_len": 16,
        "metrics": {
            "test/ppl@16": 5.0,
            "test/ppl@64": 12.345,
            "test/ppl_sw@16": 4.9,
            "test/ppl_sw@64": float("nan"),
            "test/ppl+yarn@64": 7.5,
            "val/loss": 1.61,
            "val/ppl": 5.0,
        },
    }
    lines = summary(from_json(result), tmp_path).splitlines()
    assert lines[0].startswith("posenc: rope on lm, seed 1: test perplexity")
    assert [line.split() for line in lines[1:5]] == [
        ["length", "16", "64"],
        ["ppl", "5.00", "12.35"],
        ["ppl_sw", "4.90", "-"],
        ["ppl+yarn", "-", "7.50"],
    ]
    assert "last validation: val/loss 1.61, val/ppl 5.00" in lines[5]
    assert lines[-1] == f"curves:        tensorboard --logdir {tmp_path / 'tb'}"


def test_mt_summary_has_the_overall_scores_and_the_buckets(tmp_path: Path) -> None:
    result = {
        "task": "mt",
        "encoder": "t5",
        "seed": 0,
        "eval_split": "test",
        "metrics": {
            "test/bleu": 31.234,
            "test/chrf": 55.0,
            "test/bleu@len0-10": 35.0,
            "test/bleu@len10+": 20.0,
            "test/chrf@len0-10": 60.0,
            "test/chrf@len10+": 50.0,
        },
    }
    text = summary(from_json(result), tmp_path)
    assert "  BLEU 31.23  chrF 55.00" in text
    assert [line.split() for line in text.splitlines()[3:6]] == [
        ["bucket", "len0-10", "len10+"],
        ["bleu", "35.00", "20.00"],
        ["chrf", "60.00", "50.00"],
    ]


def test_a_run_ends_by_printing_its_numbers_and_where_they_are(tmp_path: Path) -> None:
    """A real run.py (output not a terminal): plain progress lines, then the summary, whose
    numbers are metrics.json's; a preset's name leads its run directory."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            "experiment=baby_gpt",
            "trainer.max_steps=4",
            "trainer.val_check_interval=4",
            "trainer.limit_val_batches=1",
            "task.eval.max_tokens=128",
            "model.n_layers=1",
            "model.d_model=16",
            "model.n_heads=2",
            "model.d_ff=32",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = (tmp_path / "outputs" / "lm" / "learned").iterdir()
    assert run.name.startswith("baby_gpt_2")
    assert "step 4/4  train/loss" in out.stdout
    metrics = json.loads((run / "metrics.json").read_text())["metrics"]
    assert f"  ppl    {metrics['val/ppl@64']:8.2f}".split() in [
        line.split() for line in out.stdout.splitlines()
    ]
    assert f"run directory: {run}" in out.stdout
    assert f"checkpoints:   {run / 'checkpoints'}: best.ckpt, last.ckpt\n" in out.stdout
    assert "litlogger" not in out.stderr and "LeafSpec" not in out.stderr  # no noise


def test_the_summary_says_when_a_run_left_no_best_checkpoint(tmp_path: Path) -> None:
    """A run shorter than its validation interval has last.ckpt only: the summary says
    so, where commands that name best.ckpt would fail; an evaluation has none."""
    result = {"task": "lm", "encoder": "rope", "seed": 0, "seq_len": 16, "metrics": {}}
    assert "checkpoints:" not in summary(from_json(result), tmp_path)  # eval_only: no checkpoints
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"x")
    lines = summary(from_json(result), tmp_path).splitlines()
    assert lines[-2] == (
        f"checkpoints:   {tmp_path / 'checkpoints'}: last.ckpt (no best.ckpt: no validation "
        f"ran during training; use last.ckpt)"
    )


def test_threads_sets_torchs_thread_count(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1 already (as under pytest -n auto), so this can fail
    try:
        train(compose_run(tmp_path, "encoder=none", "+threads=1", "task.eval.multipliers=[1]"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_plain_progress_lines_when_not_a_terminal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="posenc.training.callbacks")
    train(
        compose_run(
            tmp_path,
            "encoder=none",
            "trainer.enable_progress_bar=true",
            "trainer.max_steps=40",
            "task.eval.multipliers=[1]",
        )
    )
    steps = [
        r.getMessage().split()[1] for r in caplog.records if r.getMessage().startswith("step ")
    ]
    assert steps == [f"{s}/40" for s in range(2, 41, 2)]


def test_final_metrics_are_logged_once_in_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(compose_run(tmp_path, "encoder=none", "task.eval.multipliers=[1]"))
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    # One point each, at the training step they were measured at (not again at step 0).
    for tag in ("test/ppl@16", "val/loss"):
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == 1 and steps[0] > 0, (tag, steps)
    assert "hp/test/ppl@16" in tags  # what the HParams tab links to


def test_an_overflowed_result_shows_as_inf_not_as_a_gap(tmp_path: Path) -> None:
    """inf is a result (a model whose loss overflowed); "-" is kept for NaN, a length
    that was not run."""
    result = {
        "task": "lm",
        "encoder": "rope",
        "seed": 0,
        "seq_len": 16,
        "metrics": {"test/ppl@16": float("inf"), "test/ppl@32": float("nan")},
    }
    lines = summary(from_json(result), tmp_path).splitlines()
    assert lines[2].split() == ["ppl", "inf", "-"]


def _failed(job: Path, error_type: str, message: str, write_failure: str | None = None) -> None:
    job.mkdir(parents=True)
    record = {"error_type": error_type, "message": message, "write_failure": write_failure}
    (job / "error.json").write_text(json.dumps(record))


def test_a_sweeps_summary_groups_the_failures_by_cause_with_the_rerun_command(
    tmp_path: Path,
) -> None:
    """Three jobs refused for the same missing file and one for another reason: each cause
    once, most frequent first, with one job's error.json and the command that reruns the
    failed jobs; no report command when no job has results."""
    for i in range(3):
        _failed(tmp_path / f"{i}_lm_rope_seed{i}", "DataUnavailableError", "no data file x")
    _failed(tmp_path / "3_lm_alibi_seed0", "ConfigError", "task.seq_len=0: must be\n positive")
    lines = sweep_lines(tmp_path, ["run.py", "-m", "encoder=rope,alibi", "seed=0,1,2"])
    assert (
        lines[0]
        == f"sweep finished: 0 of 4 jobs have results, 4 failed (error.json), in {tmp_path}"
    )
    assert lines[1] == (
        f"3 failed with DataUnavailableError: no data file x "
        f"(e.g. {tmp_path / '0_lm_rope_seed0' / 'error.json'})"
    )
    assert lines[2].startswith("1 failed with ConfigError: task.seq_len=0: must be positive (e.g.")
    assert lines[3] == (
        "once mended, rerun the failed jobs (the others are kept) with:\n  python run.py -m "
        f"encoder=rope,alibi seed=0,1,2 hydra.sweep.dir={tmp_path} resume=true"
    )
    assert len(lines) == 4 and not any(line.startswith("report:") for line in lines)


def test_a_sweeps_summary_counts_write_failures_and_names_the_report(tmp_path: Path) -> None:
    """A job with results brings the report's command; a job that could not write its
    files is counted by cause (a full disk), not by its message; a fifth distinct error
    is counted, not shown."""
    (tmp_path / "0_lm_rope_seed0").mkdir()
    (tmp_path / "0_lm_rope_seed0" / "metrics.json").write_text("{}")
    _failed(tmp_path / "1_a", "CheckpointError", "could not write", "no space left on device: /x")
    for i in range(4):
        _failed(tmp_path / f"{2 + i}_b", "RuntimeError", f"bug {i}")
    lines = sweep_lines(tmp_path, ["run.py", "-m"])
    assert lines[1] == f"report: python -m posenc.report {tmp_path}"
    assert lines[2].startswith("1 of the failed jobs could not write their files: no space left")
    assert [line.split(" (e.g.")[0] for line in lines[3:6]] == [
        f"1 failed with RuntimeError: bug {i}" for i in range(3)
    ]
    assert lines[6] == "1 more failed, 1 other cause (their error.json)"
