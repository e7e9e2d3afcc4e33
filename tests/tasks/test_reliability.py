"""Fail fast on bad configs, resume after SIGKILL, deterministic seeds, NaN stops."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc.config import ConfigError
from posenc.train import train
from tests.conftest import ROOT, TINY, compose_run

BAD = [
    ("model.n_heads=3", "model.n_heads=3: must divide model.d_model=16"),
    ("task.seq_len=-5", "task.seq_len=-5: must be a positive integer"),
    ("model.dropout=1.5", "model.dropout=1.5: must be a number in \\[0, 1\\)"),
    ("model.dropout=abc", "model.dropout='abc': must be a number"),
    ("task.eval.protocols=[strided]", "contains 'strided': allowed nonoverlap, sliding"),
    ("model.d_model=14", "head_dim \\* fraction = 7 \\* 1.0 = 7 must be an even integer"),
    ("+model.dropuot=0.1", "model.dropuot: unknown key; did you mean 'dropout'"),
    ("+encoder.bsae=500", "encoder.bsae: unknown key; did you mean 'base'"),
    ("+lr=0.1", "lr: unknown key"),
    ("seed=-1", "seed=-1: must be an integer >= 0"),
    ("task.optim.lr=0", "task.optim.lr=0: must be a positive number"),
    ("task.eval.splits=[dev]", "contains 'dev': allowed train, val, test"),
    ("tokenizer=bpe tokenizer.kind=wordpiece", "tokenizer.kind='wordpiece': allowed char, bpe"),
    ("eval_only=true", "eval_only=true: needs ckpt_path"),
    ("ckpt_path=/no/such.ckpt", "ckpt_path=/no/such.ckpt: no such file"),
    ("encoder=learned encoder.max_len=8", "task.seq_len=16: longer than encoder.max_len=8"),
    (
        "encoder=learned encoder.max_len=32 task.eval.skip_unsupported=false",
        "lengths \\[64\\] past encoder.max_len=32",
    ),
    ("encoder=rope encoder.layout=neox", "allowed: interleaved, half"),
    ("encoder=shaw encoder.max_distance=0", "max_distance must be >= 1"),
    ("+trainer.max_step=5", "trainer.max_step: unknown key; did you mean 'max_steps'"),
    ("checkpoint_every_n_steps=0", "checkpoint_every_n_steps=0: must be a positive integer"),
    ("+task.beam_size=4", "task.beam_size"),  # an MT option under task=lm
]


@pytest.mark.parametrize(("overrides", "message"), BAD)
def test_bad_config_fails_before_any_data(
    tmp_path: Path, overrides: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "nowhere"))  # data would fail later
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=message):
        train(compose_run(tmp_path, *overrides.split()))
    assert not (tmp_path / "nowhere").exists()
    assert time.perf_counter() - t0 < 30  # fails fast; generous for a loaded CI machine


def test_all_problems_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "seed=-1", "task.seq_len=0", "+model.foo=1"))
    header, *lines = str(err.value).splitlines()
    assert header == "invalid config (3 problems):"
    # One line per problem, each naming its key and what is wrong; none lost or merged.
    found = dict(line.strip().split(": ", 1) for line in lines)
    assert sorted(found) == ["model.foo", "seed=-1", "task.seq_len=0"], lines
    assert found["model.foo"].startswith("unknown key; allowed: compile, d_ff")
    assert found["seed=-1"] == "must be an integer >= 0"
    assert found["task.seq_len=0"] == "must be a positive integer"


def _metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())["metrics"]


def test_same_seed_same_numbers_other_seed_other_numbers(tmp_path: Path) -> None:
    a = train(compose_run(tmp_path / "a", "encoder=rope", "model.dropout=0.1"))["metrics"]
    b = train(compose_run(tmp_path / "b", "encoder=rope", "model.dropout=0.1"))["metrics"]
    c = train(compose_run(tmp_path / "c", "encoder=rope", "model.dropout=0.1", "seed=1"))["metrics"]
    assert a == b  # bit-identical on CPU
    assert _metrics(tmp_path / "a" / "run") == _metrics(tmp_path / "b" / "run")
    assert a["test/ppl@16"] != c["test/ppl@16"]


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    cfg = compose_run(
        tmp_path,
        "encoder=rope",
        "task.optim.lr=1e30",
        "trainer.gradient_clip_val=null",
        "trainer.max_steps=50",
        "checkpoint_every_n_steps=1",
        "task.optim.warmup_steps=1",
    )
    with pytest.raises(FloatingPointError, match=r"training loss is (nan|inf) at step \d+"):
        train(cfg)
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert all(
        torch.isfinite(v).all() for v in last["state_dict"].values() if v.is_floating_point()
    )
    assert not (tmp_path / "run" / "metrics.json").exists()


def _command(run_dir: Path, cache: Path) -> list[str]:
    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    return [
        sys.executable,
        "run.py",
        *tiny,
        "encoder=rope",
        "model.dropout=0.1",
        "trainer.max_steps=200",
        "trainer.val_check_interval=100",
        "checkpoint_every_n_steps=20",
        "resume=true",
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache}",
    ]


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path: Path) -> None:
    env = os.environ.copy()
    cache = tmp_path / "cache"
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    subprocess.run(
        _command(whole, cache), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300
    )

    proc = subprocess.Popen(
        _command(killed, cache),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    last = killed / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 240
    while not last.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert last.exists(), "no checkpoint was written before the kill"
    step = torch.load(last, weights_only=False)["global_step"]
    assert step < 200 and not (killed / "metrics.json").exists(), "the kill came too late"

    # The same command again continues from last.ckpt and ends where the whole run did.
    subprocess.run(
        _command(killed, cache), cwd=ROOT, env=env, check=True, capture_output=True, timeout=300
    )
    resumed = json.loads((killed / "metrics.json").read_text())
    assert resumed["train_steps"] == 200
    assert resumed["metrics"] == pytest.approx(_metrics(whole), rel=1e-6)


def test_runs_started_together_keep_their_own_directories(tmp_path: Path) -> None:
    """Two runs with the same overrides started in the same second (a shell loop, a
    scheduler array) write two run directories, each with its own results."""
    cmd = [
        sys.executable,
        str(ROOT / "run.py"),
        *TINY,
        "encoder=rope",
        f"paths.cache_dir={tmp_path / 'cache'}",
    ]
    procs = [
        subprocess.Popen(
            cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    runs = sorted((tmp_path / "outputs" / "lm" / "rope").iterdir())
    assert len(runs) == 2, runs
    for run in runs:
        assert (run / "metrics.json").is_file()
        assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_seed0_[0-9a-f]{8}", run.name)
