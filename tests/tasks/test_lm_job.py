"""Tiny end-to-end LM runs on the real TinyShakespeare, for every encoder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pytorch_lightning.loggers import TensorBoardLogger

from posenc.train import train
from tests.conftest import ENCODER_YAMLS, TINY, command_line, compose_config, compose_run


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
        assert (
            m["scored_tokens"][f"test/ppl_sw@{length}"] == m["scored_tokens"][f"test/ppl@{length}"]
        )


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
    again = train(
        compose_run(
            tmp_path / "b",
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={ckpt}",
            "task.eval.multipliers=[1]",
        )
    )
    assert again["train_steps"] == 0
    for key in ("test/ppl@16", "test/ppl_sw@16"):
        assert again["metrics"][key] == pytest.approx(trained["metrics"][key], rel=1e-9)


def test_hparams_hold_the_rate_steps_sizes_encoder_options_and_swept_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TensorBoard's HParams tell runs of an lr sweep apart: the learning rate, the steps,
    every model size and encoder option, and each key the command line set."""
    logged: list[dict[str, object]] = []

    def capture(self: TensorBoardLogger, params: dict[str, object], metrics: object = None) -> None:
        if metrics:  # the final call, linked to the results
            logged.append(dict(params))

    monkeypatch.setattr(TensorBoardLogger, "log_hyperparams", capture)
    with command_line(
        tmp_path, *TINY, "encoder=rope", "task.optim.lr=0.002", "task.eval.multipliers=[1]"
    ) as cfg:
        train(cfg)
    (hparams,) = logged
    assert hparams["task.optim.lr"] == 0.002
    assert hparams["trainer.max_steps"] == 3
    assert hparams["model.d_ff"] == 32
    assert hparams["encoder.base"] == 10000.0
    assert hparams["task.eval.multipliers"] == "[1]"  # set on the command line
    assert hparams["encoder"] == "rope"
    assert all(isinstance(v, int | float | str | bool) for v in hparams.values())


def test_a_variant_with_a_label_is_recorded_under_it_beside_its_parent(tmp_path: Path) -> None:
    """+variant=rope_qknorm trains rope with QK-norm and records it as rope_qknorm, so
    the report gives it a row of its own next to rope's."""
    from posenc.tuned import run_key

    cfg = compose_run(tmp_path, "+variant=rope_qknorm", "task.eval.multipliers=[1]")
    assert run_key(cfg) == ("lm", "rope_qknorm")  # the tuned-lr file's key too
    train(cfg)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert (m["encoder"], m["encoder_class"]) == ("rope_qknorm", "RoPE")
    assert m["config"]["model"]["qk_norm"] is True and m["config"]["label"] == "rope_qknorm"


def test_a_run_on_randomized_positions_gets_a_row_of_its_own(tmp_path: Path) -> None:
    """rope trained on randomized positions is recorded (and keyed for tuned rates) as
    rope_rand, so a report over it and a plain rope run shows two rows, not one average
    of both trainings."""
    from posenc.report import collect, groups
    from posenc.tuned import run_key

    for name, extra in (("plain", []), ("rand", ["model.random_positions=256"])):
        cfg = compose_run(tmp_path / name, "encoder=rope", "task.eval.multipliers=[1]", *extra)
        assert run_key(cfg) == ("lm", f"rope_{name}" if extra else "rope")
        train(cfg)
    m = json.loads((tmp_path / "rand" / "run" / "metrics.json").read_text())
    assert (m["encoder"], m["encoder_class"]) == ("rope_rand", "RoPE")
    runs, failures = collect(tmp_path)
    assert not failures and [enc for _, enc in groups(runs)] == ["rope", "rope_rand"]


def test_the_lm_gpu_preset_trains_end_to_end_on_a_tiny_text(tmp_path: Path) -> None:
    """experiment=lm_gpu with its data swapped for a small text and its sizes shrunk
    (its BPE tokenizer, bf16 mixed precision and 1x..16x evaluation kept): a finite
    perplexity at every length, from the preset's model and optimiser settings."""
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    line = " ".join(words[(i * 3) % 8] for i in range(12)) + ".\n"
    lines = [" ".join(words[(i * j) % 8] for i in range(12)) + ".\n" for j in range(1, 40)]
    (tmp_path / "train.txt").write_text(line * 40 + "".join(lines) * 4)
    (tmp_path / "val.txt").write_text("".join(lines))
    tiny = [o for o in TINY if not o.startswith(("task.eval.", "task.seq_len", "trainer.max"))]
    cfg = compose_config(
        tmp_path,
        "experiment=lm_gpu",
        "data=text_files",
        f"data.source.train={tmp_path / 'train.txt'}",
        f"data.source.val={tmp_path / 'val.txt'}",
        "task.eval.splits=[val]",
        "task.eval.max_tokens=64",
        "tokenizer.vocab_size=64",
        *tiny,
        "task.seq_len=8",
        "task.eval.sliding_stride=4",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
    )
    assert cfg.model.n_layers == 1 and cfg.trainer.precision == "bf16-mixed"
    assert list(cfg.task.eval.multipliers) == [1, 2, 4, 8, 16]
    train(cfg)
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["eval_lengths"] == [8, 16, 32, 64, 128] and m["train_steps"] == 2
    for length in m["eval_lengths"]:
        for key in (f"val/ppl@{length}", f"val/ppl_sw@{length}"):
            assert math.isfinite(m["metrics"][key]) and 1.0 < m["metrics"][key] < 64.0, key
    assert m["config"]["tokenizer"] == {"kind": "bpe", "vocab_size": 64}
