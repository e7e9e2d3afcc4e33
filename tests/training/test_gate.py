"""The learnability gate (task.learned): the callback's step and stop, validation exact
match by hand, whole runs that stop once learned or run to the cap, refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from posenc.config import ConfigError, validate
from posenc.errors import CheckpointError
from posenc.tasks.algo import AlgoTask, exact_rows
from posenc.train import train
from posenc.training.gate import LearnedGate
from tests.conftest import ROOT
from tests.tasks.test_algo_job import OPTIM, SMALL, _compose


def _validations(gate: LearnedGate, values: list[tuple[int, float]]) -> list[bool]:
    """Feed ``(step, value)`` validations to the gate; ``should_stop`` after each."""
    stops = []
    for step, value in values:
        trainer: Any = SimpleNamespace(
            sanity_checking=False,
            callback_metrics={gate.metric: torch.tensor(value)},
            global_step=step,
            should_stop=False,
            strategy=SimpleNamespace(reduce_boolean_decision=lambda x, all: x),
        )
        gate.on_validation_end(trainer, None)  # type: ignore[arg-type]
        stops.append(trainer.should_stop)
    return stops


def test_the_gate_records_the_first_step_that_meets_it_and_stops_only_when_asked() -> None:
    seq = [(250, 40.0), (500, 96.0), (750, 90.0), (1000, 97.0)]
    watching = LearnedGate("val/seq_acc", 95.0, stop=False)
    assert _validations(watching, seq) == [False, False, False, False]
    assert watching.learned_step == 500  # the first, not the last, crossing
    stopping = LearnedGate("val/seq_acc", 95.0, stop=True)
    assert _validations(stopping, seq[:2]) == [False, True]
    assert stopping.learned_step == 500
    # Losses and perplexities meet a threshold from above; equality meets it.
    loss = LearnedGate("val/loss", 1.0, stop=True)
    assert _validations(loss, [(10, 2.0), (20, 1.0)]) == [False, True]
    assert loss.learned_step == 20
    never = LearnedGate("val/passkey", 0.9, stop=True)
    assert _validations(never, [(10, 0.85), (20, float("nan"))]) == [False, False]
    assert never.learned_step is None
    # Resuming restores the step (Lightning keeps callback state in checkpoints).
    again = LearnedGate("val/seq_acc", 95.0, stop=False)
    again.load_state_dict(watching.state_dict())
    assert again.learned_step == 500
    # Testing an earlier checkpoint after fit restores its (older) state: the step stays.
    watching.load_state_dict({"learned_step": None})
    assert watching.learned_step == 500


def test_exact_rows_by_hand() -> None:
    hit = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]]).bool()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]).bool()
    # row 0: both answer tokens right; row 1: its second is wrong; row 2: no answer (pad)
    assert exact_rows(hit, mask).tolist() == [True, False, False, True]


class _Fixed(torch.nn.Module):
    """A 'model' whose logits put all mass on given tokens: ``(B, T)`` -> ``(B, T, V)``."""

    def __init__(self, argmax: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.logits = torch.nn.functional.one_hot(argmax, vocab).float() * 10

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_validation_counts_instances_whose_every_answer_token_is_right() -> None:
    """``_loss``'s exact and instance counts (val/seq_acc = 100 * exact / count)."""
    task = AlgoTask(
        vocab_size=8,
        encoder={"_target_": "posenc.encoders.rope.RoPE", "_partial_": True},
        model=SMALL,
        optim=OPTIM,
        max_steps=1,
        shape="decoder",
        top_size=4,
    )
    target = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 0], [5, 6, 7, 2]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 1, 1, 1]]).bool()
    argmax = target.clone()
    argmax[1, 2] = 4  # row 1: an answer token wrong
    argmax[0, 0] = 4  # row 0: a prompt token wrong, outside the answer: still exact
    task.model = _Fixed(argmax, 8)  # type: ignore[assignment]
    batch = {
        "input": torch.zeros_like(target),
        "target": target,
        "loss_mask": mask,
        "score_mask": mask,
    }
    sums = task._loss(batch)
    counts = tuple(int(sums[k]) for k in ("right", "tokens", "exact", "count"))
    assert counts == (6, 7, 2, 3)


ALGO_GATE = ["encoder=rope", "trainer.max_steps=6", "trainer.val_check_interval=2"]


def test_an_algo_run_stops_at_the_first_validation_that_meets_the_gate(tmp_path: Path) -> None:
    result = train(_compose(tmp_path, *ALGO_GATE, "task.learned.threshold=0"))
    assert result["train_steps"] == 2  # stopped at the first validation, cap 6
    assert (result["learned"], result["learned_step"]) == (True, 2)
    assert result["gate"] == {"metric": "val/seq_acc", "threshold": 0, "stop": True}
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (saved["learned"], saved["learned_step"]) == (True, 2)
    assert 0 <= saved["metrics"]["val/seq_acc"] <= 100


def test_a_stopped_run_tests_the_weights_that_met_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The best checkpoint by validation loss can be older than the validation that met
    the gate; the test then scores the weights that met it (here: the job never asks for
    a checkpoint, so a path that does not exist is never opened). Without a stop, the
    best checkpoint is still the one tested."""
    import posenc.training.job as job

    monkeypatch.setattr(job, "best_checkpoint", lambda trainer: str(tmp_path / "older.ckpt"))
    result = train(_compose(tmp_path, *ALGO_GATE, "task.learned.threshold=0"))
    assert (result["train_steps"], result["learned"], result["learned_step"]) == (2, True, 2)
    watching = _compose(
        tmp_path / "b", *ALGO_GATE, "task.learned.threshold=0", "task.learned.stop=false"
    )
    with pytest.raises(CheckpointError, match="older.ckpt: no such file"):
        train(watching)


def test_a_run_that_never_learns_trains_to_the_cap_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = train(
        _compose(tmp_path, *ALGO_GATE, "task.learned.metric=val/loss", "task.learned.threshold=0.0")
    )
    assert result["train_steps"] == 6
    assert (result["learned"], result["learned_step"]) == (False, None)
    assert "learned: NO (val/loss" in capsys.readouterr().out


def test_without_a_gate_nothing_is_claimed(tmp_path: Path) -> None:
    result = train(_compose(tmp_path, *ALGO_GATE, "task.learned=null"))
    assert result["train_steps"] == 6
    assert (result["gate"], result["learned"], result["learned_step"]) == (None, None, None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["task=algo", "task.learned.metric=val/bleu"],
            "task.learned.metric='val/bleu': allowed for task algo: val/seq_acc, val/acc",
        ),
        (
            ["task=algo", "task.learned.threshold=101"],
            "task.learned.threshold=101: val/seq_acc is in percent",
        ),
        (
            ["task=algo", "task.learned.threshold=high"],
            "task.learned.threshold='high': must be a finite number",
        ),
        (["task=algo", "+task.learned.patience=3"], "task.learned.patience: unknown key"),
        (["task=algo", "task.learned.stop=2"], "task.learned.stop=2: must be true or false"),
        (
            ["task.learned={metric:val/passkey,threshold:0.9}"],
            "task.learned.metric=val/passkey: needs task.passkey_mix > 0",
        ),
        (
            ["sweep=lm_passkey", "task.learned.threshold=90"],
            "task.learned.threshold=90: val/passkey is a fraction in [0, 1]; e.g. 0.9",
        ),
        (
            ["task=mt", "task.learned={metric:val/bleu,threshold:20}", "task.val_bleu_sentences=0"],
            "task.learned.metric=val/bleu: needs task.val_bleu_sentences > 0",
        ),
    ],
)
def test_bad_gates_are_refused_before_training(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        validate(_config(tmp_path, *overrides))
    assert message in str(err.value)


def test_the_presets_gates_pass_the_checks(tmp_path: Path) -> None:
    for overrides in (["task=algo"], ["sweep=lm_passkey"], ["task=lm"], ["task=mt"]):
        validate(_config(tmp_path, *overrides))


def _config(tmp_path: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config",
            overrides=[*overrides, f"paths.output_dir={tmp_path}", f"paths.cache_dir={tmp_path}"],
        )
