"""A run stopped and continued from its checkpoint ends with the weights of a run that was
never stopped: every task, with gradient accumulation and dropout, translation across
epochs. What makes it so: each training sampler starts where the trainer's step says
(tests/data/test_samplers.py checks that against Lightning's loop)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from pytorch_lightning.trainer.states import TrainerFn

from posenc.train import train
from posenc.training.callbacks import Throughput
from tests.conftest import MT_SMALL, TINY, compose_config

SIZES = {
    "lm": [*TINY, "encoder=rope", "model.dropout=0.1"],
    "mt": [
        *MT_SMALL,
        "task.max_len=10",  # the 25 shortest pairs: epochs of 6 batches
        "task.max_tokens=48",
        "task.val_bleu_sentences=2",
        "task.eval_max_sentences=2",
        "task.decode.beam_size=1",
    ],
    "algo": [
        "task=algo",
        "model.dropout=0.1",
        "model.n_layers=1",
        "model.d_model=16",
        "model.n_heads=2",
        "model.d_ff=32",
        "task.train_lengths=[1,4]",
        "task.batch_size=8",
        "task.val_per_size=2",
        "task.test_per_size=2",
    ],
}
# Batches a step: 3 does not divide the language model's epoch of 1000 batches, 4 not
# translation's of 6 here (their epochs are rounded up to whole steps).
ACCUMULATE = {"lm": 3, "mt": 4, "algo": 2}
# A large rate from the first step, so that one batch drawn otherwise changes the weights,
# on a schedule that does not depend on max_steps (the stopped run has fewer).
SHARP = [
    "task.optim.lr=1e-2",
    "task.optim.warmup_steps=1",
    "task.optim.schedule=inverse_sqrt",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "++trainer.enable_progress_bar=false",
]


def _train(tmp_path: Path, task: str, name: str, steps: int, *extra: str) -> dict:
    """A ``task`` run of ``steps`` at the sizes above, in ``tmp_path / name``."""
    return train(
        compose_config(
            tmp_path / name,
            *SIZES[task],
            *SHARP,
            f"trainer.max_steps={steps}",
            f"paths.cache_dir={tmp_path / 'cache'}",
            *extra,
        )
    )


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


@pytest.mark.parametrize("task", sorted(SIZES))
def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(
    task: str, tmp_path: Path
) -> None:
    def run(name: str, steps: int, *extra: str) -> dict:
        accumulate = f"trainer.accumulate_grad_batches={ACCUMULATE[task]}"
        return _train(tmp_path, task, name, steps, accumulate, *extra)

    whole = run("whole", 8)
    run("stopped", 3)  # inside an epoch (mt: 12 batches, epochs of 8), dropout on
    stopped = tmp_path / "stopped" / "run" / "checkpoints" / "last.ckpt"
    resumed = run("resumed", 8, f"ckpt_path={stopped}")
    assert whole["train_steps"] == resumed["train_steps"] == 8
    a, b = _weights(tmp_path / "whole" / "run"), _weights(tmp_path / "resumed" / "run")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-6, msg=key)


def test_the_validation_interval_stays_in_optimizer_steps() -> None:
    """Lightning counts val_check_interval in batches; posenc's is in steps, as max_steps."""
    from omegaconf import OmegaConf

    from posenc.training.trainer import validation_in_batches

    def batches(**trainer: object) -> dict:
        return validation_in_batches(OmegaConf.create(trainer))

    assert batches(val_check_interval=500, accumulate_grad_batches=4) == {
        "val_check_interval": 2000
    }
    assert batches(val_check_interval=500, accumulate_grad_batches=1) == {}
    assert batches(val_check_interval="00:00:10:00", accumulate_grad_batches=4) == {}
    assert batches(val_check_interval=0.5, accumulate_grad_batches=4) == {}
    assert batches(val_check_interval=None, accumulate_grad_batches=4) == {}


def _loops(ready: int, completed: int, last: bool, epochs_done: int) -> dict:
    count = {"ready": ready, "started": ready, "processed": ready, "completed": completed}
    return {
        "loops": {
            "fit_loop": {
                "epoch_loop.batch_progress": {
                    "total": {k: v + 100 for k, v in count.items()},
                    "current": count,
                    "is_last_batch": last,
                },
                "epoch_progress": {"current": {"ready": 1, "completed": epochs_done}},
            }
        }
    }


def test_a_checkpoints_batch_counts_are_set_where_the_samplers_go_on() -> None:
    from posenc.training.trainer import align_loop_state

    def aligned(ckpt: dict, accumulate: int) -> dict:
        align_loop_state(ckpt, accumulate)
        return ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]

    # Saved after fit returned at an epoch's end: the next epoch starts from nothing.
    done = aligned(_loops(6, 6, last=True, epochs_done=1), 2)
    assert done["current"] == dict.fromkeys(done["current"], 0) and not done["is_last_batch"]
    # SIGTERM after 7 batches of 3 a step: back to the window's start, batch 6.
    inside = aligned(_loops(7, 7, last=False, epochs_done=0), 3)
    assert inside["current"]["ready"] == inside["current"]["completed"] == 6
    assert inside["total"]["ready"] == 106
    # At a step, or saved by Lightning at a batch's end (completed one behind): unchanged.
    assert aligned(_loops(6, 6, last=False, epochs_done=0), 3)["current"]["ready"] == 6
    assert aligned(_loops(7, 6, last=False, epochs_done=0), 3)["current"]["ready"] == 7


def test_a_resumed_run_reports_the_time_and_throughput_of_all_its_training(
    tmp_path: Path,
) -> None:
    """The checkpoint keeps the training's time and tokens: a run resumed from it counts
    the tokens of an uninterrupted run, and the time before the stop (set here to 1000 s
    in the stopped run's checkpoint, to tell it from this process's seconds)."""

    def run(name: str, steps: int, *extra: str) -> dict:
        return _train(tmp_path, "algo", name, steps, *extra)

    def kept(name: str) -> dict:
        last = tmp_path / name / "run" / "checkpoints" / "last.ckpt"
        return torch.load(last, weights_only=False)[Throughput.STATE]

    whole = run("whole", 8)
    stopped = run("stopped", 3)
    before = kept("stopped")
    assert 0 < before["fit"] <= stopped["train_time_s"] + 0.01  # train_time_s is rounded
    assert 0 < before["tokens"] < kept("whole")["tokens"]
    ckpt = torch.load(
        tmp_path / "stopped" / "run" / "checkpoints" / "last.ckpt", weights_only=False
    )
    ckpt[Throughput.STATE]["fit"] = 1000.0
    edited = tmp_path / "edited.ckpt"  # outside the run folder, whose checksums it fails
    torch.save(ckpt, edited)
    resumed = run("resumed", 8, f"ckpt_path={edited}")
    after = kept("resumed")
    assert after["tokens"] == kept("whole")["tokens"]  # the batches of all 8 steps
    assert 1000 < resumed["train_time_s"] < 1000 + 10 * whole["train_time_s"] + 60
    assert resumed["tokens_per_s"] == round(after["tokens"] / after["seconds"], 1)
    del ckpt[Throughput.STATE]  # a checkpoint from before it was kept resumes as before
    torch.save(ckpt, edited)
    assert run("older", 8, f"ckpt_path={edited}")["train_time_s"] < 1000


@pytest.mark.parametrize("fn", [TrainerFn.FITTING, TrainerFn.TESTING, TrainerFn.VALIDATING])
def test_only_fitting_restores_the_kept_time_and_tokens(fn: TrainerFn) -> None:
    """Fitting from a checkpoint takes up its training's time and tokens; testing or
    validating one (which restores callbacks' state too) leaves the run's own."""
    t = Throughput()
    t.tokens, t.seconds, t.fit_before = 5, 2.0, 0.0
    trainer = SimpleNamespace(state=SimpleNamespace(fn=fn))
    kept = {Throughput.STATE: {"tokens": 100, "seconds": 9.0, "fit": 30.0}}
    t.on_load_checkpoint(cast(Any, trainer), cast(Any, None), kept)
    restored = (100, 9.0, 30.0) if fn == TrainerFn.FITTING else (5, 2.0, 0.0)
    assert (t.tokens, t.seconds, t.fit_before) == restored
