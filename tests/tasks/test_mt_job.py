"""Tiny end-to-end translation runs on the real Multi30k, for every encoder; config checks."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from posenc.config import ConfigError, validate
from posenc.train import train
from posenc.training.checkpoints import CheckpointError
from tests.conftest import BIDIRECTIONAL_YAMLS, MT_SMALL, ROOT

N_TEST = 12  # test sentences decoded per run
TINY = [
    *MT_SMALL,
    "task.max_len=64",
    "task.max_tokens=512",
    "task.val_bleu_sentences=4",
    f"task.eval_max_sentences={N_TEST}",
    "task.decode.beam_size=2",
    "task.decode.max_len_a=0.5",
    "task.decode.max_len_b=4",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "++trainer.enable_progress_bar=false",
]


def compose_mt(run_dir: Path, cache_dir: Path, *overrides: str) -> DictConfig:
    """The real config, composed as run.py would, writing into ``run_dir``."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(
            "config",
            overrides=[
                *TINY,
                f"paths.output_dir={run_dir}",
                f"paths.cache_dir={cache_dir}",
                *overrides,
            ],
        )


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tokenizer cache for all runs: SentencePiece is trained once."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("name", BIDIRECTIONAL_YAMLS)
def test_tiny_translation_run(tmp_path: Path, cache_dir: Path, name: str) -> None:
    run = tmp_path / "run"
    result = train(compose_mt(run, cache_dir, f"encoder={name}"))
    m = json.loads((run / "metrics.json").read_text())
    assert m["task"] == "mt" and m["encoder"] == name and m["train_steps"] == 2
    assert m["metrics"] == pytest.approx(result["metrics"], nan_ok=True)
    for key in ("test/bleu", "test/chrf", "val/loss", "val/bleu", "test/loss"):
        assert math.isfinite(m["metrics"][key]), key
    assert m["n_sentences"] == N_TEST and sum(m["buckets"].values()) == N_TEST
    assert list(m["buckets"]) == ["len0-10", "len10-20", "len20-30", "len30+"]
    for bucket, n in m["buckets"].items():
        assert math.isfinite(m["metrics"][f"test/bleu@{bucket}"]) == (n > 0)
    assert m["bleu_signature"].startswith("BLEU: nrefs:1|case:mixed")
    assert len((run / "test.hyp.txt").read_text(encoding="utf-8").split("\n")) == N_TEST + 1
    assert (run / "bleu_by_length.png").stat().st_size > 0
    assert list((run / "tb").glob("events.out.tfevents*"))


def test_eval_only_from_a_checkpoint(tmp_path: Path, cache_dir: Path) -> None:
    trained = train(compose_mt(tmp_path / "a", cache_dir, "encoder=shaw"))
    ckpt = tmp_path / "a" / "checkpoints" / "best.ckpt"
    again = train(
        compose_mt(tmp_path / "b", cache_dir, "encoder=shaw", "eval_only=true", f"ckpt_path={ckpt}")
    )
    assert again["train_steps"] == 0
    for key in ("test/bleu", "test/chrf", "test/loss"):
        assert again["metrics"][key] == pytest.approx(trained["metrics"][key], rel=1e-9)
    hyps = (tmp_path / "a" / "test.hyp.txt").read_text(encoding="utf-8")
    assert (tmp_path / "b" / "test.hyp.txt").read_text(encoding="utf-8") == hyps
    # Without the key/value cache: the same translations, token for token.
    uncached = train(
        compose_mt(
            tmp_path / "c",
            cache_dir,
            "encoder=shaw",
            "eval_only=true",
            f"ckpt_path={ckpt}",
            "task.decode.use_cache=false",
        )
    )
    assert (tmp_path / "c" / "test.hyp.txt").read_text(encoding="utf-8") == hyps
    assert uncached["metrics"]["test/bleu"] == trained["metrics"]["test/bleu"]


def test_a_checkpoint_evaluates_with_a_tokenizer_trained_elsewhere(
    tmp_path: Path, cache_dir: Path
) -> None:
    """Another checkout or machine retrains SentencePiece into another cache folder: the
    same model, so the checkpoint is accepted and translates the same. Checkpoints from
    before the path-free fingerprint (the whole model file's hash) are accepted too."""
    train(compose_mt(tmp_path / "a", cache_dir, "encoder=rope"))
    ckpt = tmp_path / "a" / "checkpoints" / "best.ckpt"
    hyps = (tmp_path / "a" / "test.hyp.txt").read_text(encoding="utf-8")
    elsewhere = tmp_path / "other-cache"
    train(
        compose_mt(tmp_path / "b", elsewhere, "encoder=rope", "eval_only=true", f"ckpt_path={ckpt}")
    )
    assert (tmp_path / "b" / "test.hyp.txt").read_text(encoding="utf-8") == hyps
    (model,) = elsewhere.glob("*.model")
    assert model.read_bytes() != next(cache_dir.glob(model.name)).read_bytes()  # paths inside

    old = torch.load(ckpt, weights_only=True)
    old["posenc"]["tokenizer"] = hashlib.sha256(model.read_bytes()).hexdigest()
    torch.save(old, tmp_path / "old.ckpt")
    train(
        compose_mt(
            tmp_path / "c",
            elsewhere,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={tmp_path / 'old.ckpt'}",
        )
    )
    assert (tmp_path / "c" / "test.hyp.txt").read_text(encoding="utf-8") == hyps
    # ... but only with the very model file it names.
    with pytest.raises(CheckpointError, match="trained with tokenizer"):
        train(
            compose_mt(
                tmp_path / "d",
                cache_dir,
                "encoder=rope",
                "eval_only=true",
                f"ckpt_path={tmp_path / 'old.ckpt'}",
            )
        )
    # Training on from either checkpoint (the resume path) accepts them the same way.
    for i, given in enumerate((ckpt, tmp_path / "old.ckpt")):
        out = train(
            compose_mt(
                tmp_path / f"e{i}",
                elsewhere,
                "encoder=rope",
                "trainer.max_steps=3",
                f"ckpt_path={given}",
            )
        )
        assert out["train_steps"] == 3


def test_train_short_experiment_drops_long_sources(tmp_path: Path, cache_dir: Path) -> None:
    m = train(compose_mt(tmp_path, cache_dir, "experiment=mt_train_short"))
    stats = m["data_stats"]
    assert m["max_train_src_len"] == 14 and stats["dropped_max_train_src_len"] > 0
    dropped = sum(
        stats[k] for k in ("dropped_empty", "dropped_max_len", "dropped_max_train_src_len")
    )
    assert stats["train_kept"] + dropped == 29000
    assert list(m["buckets"]) == ["len0-10", "len10-15", "len15-20", "len20-25", "len25+"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["task.decode.beam_size=0"], "task.decode.beam_size=0: must be a positive integer"),
        (["task.label_smoothing=1.0"], r"task.label_smoothing=1.0: must be in \[0, 1\)"),
        (["task.length_buckets=[0,20,10]"], r"task.length_buckets=\[0, 20, 10\]: .*increasing"),
        (["task.max_tokens=0"], "task.max_tokens=0: must be a positive integer"),
        (["task.decode.length_penalty=-1"], "task.decode.length_penalty=-1: must be a number"),
        (["task.eval_split=train"], "task.eval_split='train': allowed test, val"),
        (["task.val_bleu_sentences=0"], "task.monitor=val/bleu: needs task.val_bleu_sentences"),
        (["task.monitor_mode=min"], "task.monitor_mode='min': val/bleu needs max"),
        (["encoder=learned", "encoder.max_len=32"], "task.max_len=64: longer than encoder"),
    ],
)
def test_bad_mt_config_is_refused(
    tmp_path: Path, overrides: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "nowhere"))  # data would fail later
    with pytest.raises(ConfigError, match=message):
        train(compose_mt(tmp_path, tmp_path, *overrides))


def test_mt_options_with_the_lm_task_are_refused(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "task=lm",
                "+task.max_train_src_len=14",
                f"paths.output_dir={tmp_path}",
                f"paths.cache_dir={tmp_path}",
            ],
        )
    with pytest.raises(ConfigError, match="task.max_train_src_len=14: a translation option"):
        validate(cfg)


def test_mt_sets_its_own_trainer_defaults() -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        mt = compose("config", overrides=["task=mt"])
        lm = compose("config", overrides=["task=lm"])
    assert mt.trainer.max_steps != lm.trainer.max_steps
    assert mt.tokenizer.vocab_size == 8000 and mt.data.name == "multi30k"


def test_mt_long_preset_is_the_default_job_run_longer(tmp_path: Path) -> None:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        base = compose("config", overrides=["task=mt"])
        long = compose(
            "config",
            overrides=[
                "task=mt",
                "experiment=mt_long",
                f"paths.output_dir={tmp_path}",
                f"paths.cache_dir={tmp_path}",
            ],
        )
    assert (long.trainer.max_steps, long.trainer.val_check_interval) == (1500, 500)
    assert base.trainer.max_steps == 500
    drop = ("trainer", "paths", "experiment")
    assert {k: v for k, v in long.items() if k not in drop} == {
        k: v for k, v in base.items() if k not in drop
    }
    validate(long)
