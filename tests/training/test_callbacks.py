"""The progress display: a bar counting steps to ``trainer.max_steps`` with evaluation
bars named by what they evaluate, and plain lines wherever no bar is drawn."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from posenc.schema import typed
from posenc.train import train
from posenc.training.callbacks import PlainProgress, StepProgressBar, Throughput
from posenc.training.trainer import build_trainer
from tests.conftest import compose_run


def test_the_bar_counts_steps_to_max_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2000-step run's bar reads step/2000 (not "Epoch 0/-2 ... k/1000", the batches up
    to the validation interval of a loader with no end)."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    cfg = typed(
        compose_run(
            tmp_path,
            "trainer.enable_progress_bar=true",
            "trainer.max_steps=2000",
            "trainer.val_check_interval=1000",
        )
    )
    trainer = build_trainer(cfg, tmp_path, Throughput())
    bar = trainer.progress_bar_callback
    assert isinstance(bar, StepProgressBar)
    bar.setup(trainer, trainer.lightning_module, "fit")
    assert bar.total_train_batches == 2000
    assert "Epoch" not in bar._get_train_description(0)


def test_evaluation_bars_name_what_they_evaluate() -> None:
    class Task:
        eval_labels = ["test ppl@16 nonoverlap", "test ppl_sw@64 sliding"]

    bar = StepProgressBar()
    bar._trainer = type("T", (), {"lightning_module": Task()})()  # type: ignore[assignment]
    bar._current_eval_dataloader_idx = 1
    assert bar.test_description == "test ppl_sw@64 sliding"


def test_without_a_bar_a_run_logs_its_steps_and_evaluations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With the bar turned off a run still says where it is: step, loss and elapsed time
    while training, then each evaluation by name."""
    cfg = compose_run(tmp_path, "encoder=rope", "task.eval.multipliers=[1]")
    assert cfg.trainer.enable_progress_bar is False
    with caplog.at_level(logging.INFO, logger="posenc.training.callbacks"):
        train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "posenc.training.callbacks"]
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and steps[-1].startswith("step 3/3  train/loss ")
    assert all("elapsed" in line for line in steps)
    evals = [line for line in lines if line.startswith("evaluating ")]
    assert evals == [
        "evaluating test ppl@16 nonoverlap (1/2)",
        "evaluating test ppl_sw@16 sliding (2/2)",
    ]


def test_plain_progress_is_the_display_without_a_bar(tmp_path: Path) -> None:
    cfg = typed(compose_run(tmp_path))
    trainer = build_trainer(cfg, tmp_path, Throughput())
    assert any(isinstance(c, PlainProgress) for c in trainer.callbacks)  # type: ignore[attr-defined]
