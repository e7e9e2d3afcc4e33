"""The LM job's passkey evaluation end to end, with a tiny model on TinyShakespeare."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posenc.data.lm import PasskeyDraw
from posenc.eval.passkey import evaluate_length, greedy
from posenc.tasks.lm import LMTask
from posenc.tasks.lm_job import lm_datamodule, passkey_settings
from posenc.train import train
from posenc.training.trainer import load_for_eval
from tests.conftest import compose_run

# seq_len 64 holds a training passkey sequence with a 2-letter key (the format needs 64).
PASSKEY = [
    "task.seq_len=64",
    "task.eval.multipliers=[1,2]",
    "task.passkey_mix=0.5",
    "task.eval.passkey.multipliers=[1,2]",
    "task.eval.passkey.depths=[0,0.5,1]",
    "task.eval.passkey.samples=4",
    "task.eval.passkey.key_len=2",
]


@pytest.fixture(scope="module")
def rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("rope")
    # The passkey gate of sweep=lm_passkey, at a threshold any model meets.
    gate = "task.learned={metric:val/passkey,threshold:0.0,stop:false}"
    train(compose_run(tmp, "encoder=rope", *PASSKEY, gate))
    return tmp / "run"


def test_validation_scores_retrieval_at_1x_on_the_validation_split(rope: Path) -> None:
    """``val/passkey`` (the gate's metric) is the test grid's evaluation at the training
    length, on validation text, of the weights of the last validation (step 3 = last.ckpt)."""
    m = json.loads((rope / "metrics.json").read_text())
    assert (m["learned"], m["learned_step"]) == (True, 3)
    assert m["gate"] == {"metric": "val/passkey", "threshold": 0.0, "stop": False}
    cfg = compose_run(
        rope.parent / "val",
        "encoder=rope",
        *PASSKEY,
        "eval_only=true",
        f"ckpt_path={rope / 'checkpoints' / 'last.ckpt'}",
    )
    dm = lm_datamodule(cfg)
    dm.setup()
    model = load_for_eval(LMTask, cfg, dm.vocab_size).model.eval()
    acc = evaluate_length(
        greedy(model),
        passkey_settings(cfg).format(dm.tokenizer),
        dm.lm_split_tokens("val"),
        64,
        [0.0, 0.5, 1.0],
        samples=4,
        seed=0,
        batch_size=3,
    )
    assert m["metrics"]["val/passkey"] == pytest.approx(sum(acc) / 3)


def test_metrics_json_has_the_grid_and_scalars(rope: Path) -> None:
    m = json.loads((rope / "metrics.json").read_text())
    p = m["passkey"]
    assert p["lengths"] == [64, 128] and p["depths"] == [0.0, 0.5, 1.0]
    assert (p["key_len"], p["samples"], p["seed"]) == (2, 4, 0)
    grid = p["accuracy"]["test"]
    assert len(grid) == 2 and all(len(row) == 3 for row in grid)
    for length, row in zip(p["lengths"], grid, strict=True):
        assert all(v in (0.0, 0.25, 0.5, 0.75, 1.0) for v in row)  # 4 keys per cell
        assert m["metrics"][f"test/passkey@{length}"] == pytest.approx(sum(row) / 3)
    assert "test/ppl@128" in m["metrics"] and not m["skipped"]


def test_grid_equals_a_fresh_evaluation_of_the_best_checkpoint(rope: Path) -> None:
    """The job's numbers are what the evaluation gives on the weights it reports."""
    m = json.loads((rope / "metrics.json").read_text())
    cfg = compose_run(
        rope.parent / "again",
        "encoder=rope",
        *PASSKEY,
        "eval_only=true",
        f"ckpt_path={rope / 'checkpoints' / 'best.ckpt'}",
    )
    dm = lm_datamodule(cfg)
    dm.setup()
    model = load_for_eval(LMTask, cfg, dm.vocab_size).model.eval()
    for length, row in zip([64, 128], m["passkey"]["accuracy"]["test"], strict=True):
        acc = evaluate_length(
            greedy(model),
            passkey_settings(cfg).format(dm.tokenizer),
            dm.lm_split_tokens("test"),
            length,
            [0.0, 0.5, 1.0],
            samples=4,
            seed=0,
            batch_size=3,
        )
        assert acc == row


def test_tensorboard_has_the_scalars_and_heatmap(rope: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(rope / "tb"), size_guidance={"images": 0})
    acc.Reload()
    m = json.loads((rope / "metrics.json").read_text())
    for length in (64, 128):
        events = acc.Scalars(f"test/passkey@{length}")
        assert [e.value for e in events] == [pytest.approx(m["metrics"][f"test/passkey@{length}"])]
    assert {"test/passkey", "test/ppl_vs_length"} <= set(acc.Tags()["images"])


def test_training_batches_held_the_mix(tmp_path: Path) -> None:
    cfg = compose_run(tmp_path, "encoder=rope", *PASSKEY)
    dm = lm_datamodule(cfg)
    dm.setup()
    sampler = dm.train_dataloader().sampler
    slots = [x for _, x in zip(range(400), iter(sampler), strict=False)]
    assert sum(isinstance(x, PasskeyDraw) for x in slots) == 200


def test_learned_skips_lengths_past_max_len(tmp_path: Path) -> None:
    result = train(compose_run(tmp_path, "encoder=learned", "encoder.max_len=64", *PASSKEY))
    grid = result["passkey"]["accuracy"]["test"]
    assert all(math.isnan(v) for v in grid[1]) and all(math.isfinite(v) for v in grid[0])
    assert math.isnan(result["metrics"]["test/passkey@128"])
    assert "at most 64 positions" in result["skipped"]["test/passkey@128"]
    assert math.isfinite(result["metrics"]["test/passkey@64"])
    on_disk = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert math.isnan(on_disk["metrics"]["test/passkey@128"])


def test_off_by_default(tmp_path: Path) -> None:
    result = train(compose_run(tmp_path, "encoder=none", "task.eval.multipliers=[1]"))
    assert result["passkey"] == {}
    assert not [k for k in result["metrics"] if "passkey" in k]


@pytest.mark.parametrize(
    ("gate", "measure", "skips"),
    [
        ("{metric:val/passkey,threshold:1.0,stop:false}", False, True),
        ("{metric:val/passkey,threshold:1.0,stop:false}", True, False),
        # a gate on another metric says nothing about retrieval: every length is tested
        ("{metric:val/ppl,threshold:1.0,stop:false}", False, False),
    ],
)
def test_a_run_that_missed_its_passkey_gate_is_tested_up_to_1x(
    tmp_path: Path, gate: str, measure: bool, skips: bool
) -> None:
    """A tiny model neither retrieves 100% of keys nor reaches ppl 1: past the training
    length its grid is NaN with the reason for a missed passkey gate, unless
    measure_unlearned asks for every length."""
    result = train(
        compose_run(
            tmp_path,
            "encoder=rope",
            *PASSKEY,
            f"task.learned={gate}",
            f"task.eval.passkey.measure_unlearned={str(measure).lower()}",
        )
    )
    assert result["learned"] is False
    grid = result["passkey"]["accuracy"]["test"]
    assert all(math.isfinite(v) for v in grid[0])
    assert all(math.isfinite(v) for v in grid[1]) != skips
    assert math.isfinite(result["metrics"]["test/passkey@128"]) != skips
    reason = result["skipped"].get("test/passkey@128", "")
    assert ("missed its passkey gate" in reason) == skips
    assert math.isfinite(result["metrics"]["test/ppl@128"])  # perplexity is measured still


def test_a_run_stopped_during_the_grid_scores_only_the_lengths_left_when_resumed(
    rope: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid keeps each finished length in the run folder: a run stopped at its second
    length and resumed scores that length alone, and its metrics are the uninterrupted
    run's (the ``rope`` fixture, same settings); the file is gone once metrics.json is."""
    from posenc.tasks import lm_passkey

    real = lm_passkey.evaluate_length
    scored: list[int] = []

    def stopped_at_128(*args: object, **kw: object) -> list[float]:
        if kw.get("log") is not None:  # the test grid (validation passes no log)
            scored.append(int(args[3]))  # type: ignore[call-overload]
            if args[3] == 128 and len(scored) == 2:
                raise KeyboardInterrupt  # as a stop lands mid-length
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lm_passkey, "evaluate_length", stopped_at_128)
    gate = "task.learned={metric:val/passkey,threshold:0.0,stop:false}"
    args = ("encoder=rope", *PASSKEY, gate)
    with pytest.raises(KeyboardInterrupt):
        train(compose_run(tmp_path, *args))
    run = tmp_path / "run"
    kept = json.loads((run / lm_passkey.PROGRESS).read_text())
    assert list(kept["rows"]) == ["test/passkey@64"] and not (run / "metrics.json").exists()
    resumed = train(compose_run(tmp_path, *args, "resume=true"))
    assert scored == [64, 128, 128]
    whole = json.loads((rope / "metrics.json").read_text())
    assert resumed["passkey"] == whole["passkey"]
    assert resumed["metrics"] == pytest.approx(whole["metrics"], rel=1e-6)
    assert not (run / lm_passkey.PROGRESS).exists()


def test_kept_lengths_are_read_back_for_the_same_weights_and_settings_only(
    tmp_path: Path,
) -> None:
    import torch

    from posenc.tasks.lm_passkey import Finished, Settings

    path = tmp_path / "passkey_progress.json"
    settings = Settings(2, [64, 128], [0.0, 1.0], 4, 0, False, ["test"], 64, 8)
    model = torch.nn.Linear(3, 2)
    Finished(path, model, settings, write=True).add("test/passkey@64", [0.25, 1.0])
    assert Finished(path, model, settings, write=True).rows == {"test/passkey@64": [0.25, 1.0]}
    Finished(path, model, settings, write=False).add("test/passkey@128", [0.0, 0.0])
    assert list(json.loads(path.read_text())["rows"]) == ["test/passkey@64"]  # not rank zero
    other = torch.nn.Linear(3, 2)
    assert Finished(path, other, settings, write=True).rows == {}  # other weights
    other.load_state_dict(model.state_dict())  # the same weights in another module
    assert list(Finished(path, other, settings, write=True).rows) == ["test/passkey@64"]
    more = Settings(2, [64, 128], [0.0, 1.0], 8, 0, False, ["test"], 64, 8)
    assert Finished(path, model, more, write=True).rows == {}  # other settings (samples)
    path.write_text(path.read_text()[:20])  # cut short
    assert Finished(path, model, settings, write=True).rows == {}


def test_a_run_the_gate_stopped_and_resumed_during_its_test_trains_no_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate stops a run at step 3 of 6; stopped again during its passkey grid and
    resumed, the run trains no step further and scores the weights that met the gate, as
    the uninterrupted run does. (It trained on to the next validation, step 6, and tested
    that later model under the gate's step.)"""
    from posenc.tasks import lm_passkey

    gate = "task.learned={metric:val/passkey,threshold:0.0,stop:true}"
    args = ("encoder=rope", *PASSKEY, gate, "trainer.max_steps=6")
    whole = train(compose_run(tmp_path / "whole", *args))
    assert whole["learned_step"] == whole["train_steps"] == 3
    real = lm_passkey.evaluate_length

    def stop(*args: object, **kw: object) -> list[float]:
        if kw.get("log") is not None:  # the test grid (validation passes no log)
            raise KeyboardInterrupt
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(lm_passkey, "evaluate_length", stop)
    with pytest.raises(KeyboardInterrupt):
        train(compose_run(tmp_path / "stopped", *args))
    monkeypatch.setattr(lm_passkey, "evaluate_length", real)
    resumed = train(compose_run(tmp_path / "stopped", *args, "resume=true"))
    assert (resumed["learned_step"], resumed["train_steps"]) == (3, 3)
    assert resumed["passkey"] == whole["passkey"]
    assert resumed["metrics"] == pytest.approx(whole["metrics"], rel=1e-6)
