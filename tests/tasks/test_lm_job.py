"""Tiny end-to-end LM runs on the real TinyShakespeare, for every encoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from posenc.config import ConfigError
from posenc.train import train
from tests.conftest import ENCODER_YAMLS, ROOT

TINY = [
    "model.n_layers=1", "model.d_model=16", "model.n_heads=2", "model.d_ff=32",
    "task.seq_len=16", "task.batch_size=4", "task.eval_batch_size=4",
    "task.eval.multipliers=[1,4]", "task.eval.max_tokens=256", "task.eval.sliding_stride=4",
    "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
]


def compose_run(tmp_path: Path, *overrides: str) -> DictConfig:
    """The real config, composed as run.py would, writing into tmp_path."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[
            *TINY, f"paths.output_dir={tmp_path / 'run'}", f"paths.cache_dir={tmp_path / 'cache'}",
            *overrides])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = {}
    for name in ENCODER_YAMLS:
        extra = ["encoder.max_len=32"] if name == "learned" else []  # 4x = 64 > max_len
        tmp = tmp_path_factory.mktemp(name)
        train(compose_run(tmp, f"encoder={name}", *extra))
        out[name] = json.loads((tmp / "run" / "metrics.json").read_text())
    return out


@pytest.mark.parametrize("name", ENCODER_YAMLS)
def test_metrics_json_is_complete_and_finite(runs: dict[str, dict], name: str) -> None:
    m = runs[name]
    assert m["encoder"] == name and m["task"] == "lm" and m["seed"] == 0
    assert m["eval_lengths"] == [16, 64]
    for length in (16, 64):
        for key in (f"test/ppl@{length}", f"test/ppl_sw@{length}"):
            value = m["metrics"][key]
            if name == "learned" and length == 64:
                assert math.isnan(value)
                assert "at most 32 positions" in m["skipped"][key]
            else:
                assert math.isfinite(value) and 1.0 < value < 200.0, (key, value)
    assert math.isfinite(m["metrics"]["val/loss"])
    assert m["n_params"] > 0 and m["tokens_per_s"] > 0 and m["peak_memory_mb"] > 0
    assert m["train_steps"] == 3


@pytest.mark.parametrize("name", ["rope", "xl", "sinusoidal"])
def test_lengths_beyond_training_were_really_evaluated(runs: dict[str, dict], name: str) -> None:
    m = runs[name]
    # max_tokens=256 at L=64: four whole windows of 64 tokens, every position scored.
    assert len(m["loss_by_position"]["test/ppl@64"]) == 64
    assert m["scored_tokens"]["test/ppl@64"] == 256
    assert all(math.isfinite(x) for x in m["loss_by_position"]["test/ppl@64"])


@pytest.mark.parametrize("name", ["rope", "none"])
def test_sliding_protocol_scores_each_token_once(runs: dict[str, dict], name: str) -> None:
    m = runs[name]
    for length in (16, 64):
        assert m["scored_tokens"][f"test/ppl_sw@{length}"] == m["scored_tokens"][
            f"test/ppl@{length}"]


def test_run_writes_checkpoints_and_tensorboard(tmp_path: Path) -> None:
    train(compose_run(tmp_path, "encoder=rope", "task.eval.multipliers=[1]"))
    run = tmp_path / "run"
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert list((run / "tb").glob("events.out.tfevents*"))
    # A second run into the same directory is refused: nothing is overwritten.
    with pytest.raises(FileExistsError, match="never overwrites"):
        train(compose_run(tmp_path, "encoder=rope"))


def test_eval_only_from_a_checkpoint(tmp_path: Path) -> None:
    first = tmp_path / "a"
    trained = train(compose_run(first, "encoder=rope", "task.eval.multipliers=[1]"))
    # The training run evaluated its best checkpoint; evaluating that file again must
    # give the same numbers to the last digit.
    ckpt = first / "run" / "checkpoints" / "best.ckpt"
    again = train(compose_run(tmp_path / "b", "encoder=rope", "eval_only=true",
                              f"ckpt_path={ckpt}", "task.eval.multipliers=[1]"))
    assert again["train_steps"] == 0
    for key in ("test/ppl@16", "test/ppl_sw@16"):
        assert again["metrics"][key] == pytest.approx(trained["metrics"][key], rel=1e-9)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_heads=3", "model.n_heads=3: must divide model.d_model=16"),
        ("task.seq_len=-5", "task.seq_len=-5: must be a positive integer"),
        ("model.dropout=1.5", "model.dropout=1.5: must be in"),
        ("task.eval.protocols=[strided]", "allowed nonoverlap, sliding"),
        ("model.d_model=14", "head_dim \\* fraction = 7 \\* 1.0 = 7 must be an even integer"),
    ],
)
def test_bad_config_fails_before_any_data(tmp_path: Path, override: str, message: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "nowhere"))  # data would fail later
    with pytest.raises(ConfigError, match=message):
        train(compose_run(tmp_path, override))
