"""Checkpoints and caches posenc can trust (#27 points 4-7 and 10): checked against the
config, checksummed, replaced in place, saved on SIGTERM; failed saves stop the run; every
tensor checked against the digests the file carries, wherever it lies."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc.errors import CacheError, CheckpointError
from posenc.train import train
from posenc.training import checkpoints, digests
from posenc.training.rundir import write_failure
from posenc.training.trainer import best_checkpoint, command_line_keys
from tests.conftest import ROOT, TINY, command_line, compose_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny RoPE run (the checkpoints the tests below load)."""
    root = tmp_path_factory.mktemp("trained")
    train(compose_run(root, "encoder=rope", "task.eval.multipliers=[1]"))
    return root / "run"


MISMATCHED_EVAL = [
    ("encoder=alibi", "encoder: checkpoint 'rope', config 'alibi'"),
    ("model.d_model=32", "model.d_model: checkpoint 16, config 32"),
    ("model.n_layers=3", "model.n_layers: checkpoint 1, config 3"),
    ("encoder.layout=half", "encoder.layout: checkpoint 'interleaved', config 'half'"),
]


@pytest.mark.parametrize(("override", "message"), MISMATCHED_EVAL)
def test_eval_only_refuses_a_checkpoint_of_another_model(
    trained: Path, tmp_path: Path, override: str, message: str
) -> None:
    ckpt = trained / "checkpoints" / "best.ckpt"
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        train(
            compose_run(tmp_path, "encoder=rope", override, "eval_only=true", f"ckpt_path={ckpt}")
        )
    assert not (tmp_path / "run" / "metrics.json").exists()


#: TINY without the model's sizes: what a user types to evaluate a checkpoint.
NO_SIZES = [o for o in TINY if not o.startswith("model.")]


def test_a_checkpoint_of_another_scheme_or_task_is_named_in_one_line_with_the_fix(
    trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Not a line for each option of either scheme (RoPE's fourteen), nor for each key
    that follows from another task: the scheme or task, and the override that fits; an
    LM's sizes are not taken into a translation run first."""
    caplog.set_level(logging.INFO, logger="posenc")
    ckpt = trained / "checkpoints" / "best.ckpt"
    cases = [
        ("encoder=alibi", "encoder: checkpoint 'rope', config 'alibi'", "(encoder=rope)"),
        ("task=mt", "task.name: checkpoint 'lm', config 'mt'", "(task=lm)"),
    ]
    for i, (override, line, fix) in enumerate(cases):
        rest = (
            [o for o in NO_SIZES if not o.startswith("task.")]
            if override == "task=mt"
            else NO_SIZES
        )
        with (
            command_line(
                tmp_path / str(i), *rest, override, "eval_only=true", f"ckpt_path={ckpt}"
            ) as cfg,
            pytest.raises(CheckpointError) as err,
        ):
            train(cfg)
        listed = [x for x in str(err.value).splitlines() if x.startswith("  ")]
        assert listed == [f"  {line}"], str(err.value)
        assert f"trained with {fix}" in str(err.value)
        if override == "task=mt":
            assert "the model as" not in caplog.text, caplog.text
        caplog.clear()


def test_eval_only_takes_the_model_sizes_from_the_checkpoint(trained: Path, tmp_path: Path) -> None:
    """``eval_only=true ckpt_path=<small model>`` evaluates it with no sizes retyped (the
    defaults are 4 layers of width 128; the checkpoint's 1 of 16): the same numbers as
    the training run's own evaluation."""
    ckpt = trained / "checkpoints" / "best.ckpt"
    with command_line(tmp_path, *NO_SIZES, "encoder=rope", "eval_only=true", f"ckpt_path={ckpt}",
                      "task.eval.multipliers=[1]") as cfg:  # fmt: skip
        assert cfg.model.d_model == 128
        out = train(cfg)
    first = json.loads((trained / "metrics.json").read_text())
    assert out["config"]["model"]["d_model"] == 16
    assert out["config"]["model"]["n_layers"] == 1
    assert out["metrics"]["test/ppl@16"] == pytest.approx(first["metrics"]["test/ppl@16"], rel=1e-9)


def test_eval_only_keeps_the_checkpoints_label(tmp_path: Path) -> None:
    """A run of +variant=rope_qknorm evaluated with eval_only (no variant given) is
    recorded as rope_qknorm, with QK-norm on, not as plain rope."""
    train(compose_run(tmp_path / "a", "+variant=rope_qknorm", "task.eval.multipliers=[1]"))
    ckpt = tmp_path / "a" / "run" / "checkpoints" / "last.ckpt"
    with command_line(tmp_path / "b", *NO_SIZES, "encoder=rope", "eval_only=true",
                      f"ckpt_path={ckpt}", "task.eval.multipliers=[1]") as cfg:  # fmt: skip
        out = train(cfg)
    assert out["encoder"] == "rope_qknorm" and out["config"]["model"]["qk_norm"] is True


def test_eval_only_refuses_sizes_given_against_the_checkpoint_in_one_line(
    trained: Path, tmp_path: Path
) -> None:
    ckpt = trained / "checkpoints" / "best.ckpt"
    with (
        command_line(
            tmp_path, *NO_SIZES, "model.d_model=32", "eval_only=true", f"ckpt_path={ckpt}"
        ) as cfg,
        pytest.raises(CheckpointError) as err,
    ):
        train(cfg)
    message = str(err.value)
    assert "\n" not in message
    assert "model.d_model=32 was given but the checkpoint's model has model.d_model=16" in message
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_command_line_keys_name_what_the_user_set(tmp_path: Path) -> None:
    assert command_line_keys(compose_run(tmp_path)) is None  # composed by hand: unknown
    with command_line(tmp_path, "encoder=alibi", "model.d_ff=8", "+encoder.x=1") as cfg:
        keys = command_line_keys(cfg)
    assert keys is not None
    assert {"encoder._target_", "model.d_ff", "encoder.x"} <= keys
    assert "model.d_model" not in keys


def test_eval_only_of_an_mt_checkpoint_under_task_lm_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "fake.ckpt"
    mt_record = {"config": {"task": {"name": "mt"}}, "tokenizer": None}
    torch.save({"state_dict": {}, "posenc": mt_record}, ckpt)
    with pytest.raises(CheckpointError, match="task.name: checkpoint 'mt', config 'lm'"):
        train(compose_run(tmp_path, "eval_only=true", f"ckpt_path={ckpt}"))


@pytest.mark.parametrize(
    ("encoder", "key", "old"),
    [
        ("sinusoidal", "amplitude", 1.0),
        ("deberta", "far_keys", "last_bucket"),
        ("stickbreak", "remainder", "value"),
    ],
)
def test_checkpoints_from_before_a_changed_default_name_the_old_value(
    tmp_path: Path, encoder: str, key: str, old: object
) -> None:
    """#33 added keys whose defaults differ from what older runs did: a checkpoint
    without the key is refused under the new default, with the value it ran with, and
    taken with that value."""
    from omegaconf import OmegaConf

    cfg = compose_run(tmp_path, f"encoder={encoder}")
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("hydra", None)
    new = saved["encoder"].pop(key)
    assert new != old
    ckpt = {"posenc": {"config": saved}}
    message = (
        f"encoder.{key}: checkpoint '<unset>', config {new!r} (the checkpoint "
        f"predates the key; it ran as encoder.{key}={old})"
    )
    with pytest.raises(CheckpointError, match=re.escape(message)):
        checkpoints.check_config("x.ckpt", ckpt, cfg, resume=False)
    cfg.encoder[key] = old
    assert checkpoints.check_config("x.ckpt", ckpt, cfg, resume=False) == {}


def test_checkpoints_from_before_keys_that_kept_the_old_behaviour_are_taken(
    tmp_path: Path,
) -> None:
    """FoX's bias_init, decay times and pro, and model.qkv_bias came with defaults that
    do what older runs did: a checkpoint without them fits the default config."""
    from omegaconf import OmegaConf

    cfg = compose_run(tmp_path, "encoder=fox")
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("hydra", None)
    for key in ("bias_init", "decay_time_min", "decay_time_max", "pro"):
        saved["encoder"].pop(key)
    saved["model"].pop("qkv_bias")
    assert (
        checkpoints.check_config("x.ckpt", {"posenc": {"config": saved}}, cfg, resume=False) == {}
    )
    cfg.encoder.pro = True
    with pytest.raises(
        CheckpointError, match=re.escape("encoder.pro: checkpoint '<unset>', config True")
    ):
        checkpoints.check_config("x.ckpt", {"posenc": {"config": saved}}, cfg, resume=False)


def test_a_checkpoint_from_before_a_changed_default_is_rebuilt_as_it_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stick-breaking checkpoint written before ``encoder.remainder`` existed (config
    and hyperparameters without it: it ran as ``value``) is evaluated under today's
    ``head_bias`` default with nothing retyped, to the same numbers as its own run, and
    ``posenc.generate`` reads it: its model is rebuilt as it ran, not with the new default
    (whose extra parameters the file lacks)."""
    train(compose_run(tmp_path / "a", "encoder=stickbreak", "encoder.remainder=value",
                      "task.eval.multipliers=[1]"))  # fmt: skip
    ran = tmp_path / "a" / "run"
    old = tmp_path / "old.ckpt"
    ckpt = torch.load(ran / "checkpoints" / "best.ckpt", weights_only=True)
    del ckpt["posenc"]["config"]["encoder"]["remainder"]
    del ckpt["hyper_parameters"]["encoder"]["remainder"]
    torch.save(digests.seal(ckpt), old)
    with command_line(tmp_path / "b", *NO_SIZES, "encoder=stickbreak", "eval_only=true",
                      f"ckpt_path={old}", "task.eval.multipliers=[1]") as cfg:  # fmt: skip
        assert cfg.encoder.remainder == "head_bias"
        out = train(cfg)
    first = json.loads((ran / "metrics.json").read_text())
    assert out["config"]["encoder"]["remainder"] == "value"
    assert out["metrics"]["test/ppl@16"] == pytest.approx(first["metrics"]["test/ppl@16"], rel=1e-9)
    from posenc import generate

    assert generate.main([str(old), "--temperature", "0", "--tokens", "5"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_eval_only_records_the_checkpoints_training_settings(trained: Path, tmp_path: Path) -> None:
    """A training setting given with eval_only has no effect: metrics.json keeps the
    checkpoint's value (and the run says so)."""
    ckpt = trained / "checkpoints" / "best.ckpt"
    out = train(
        compose_run(
            tmp_path,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={ckpt}",
            "task.optim.lr=0.5",
            "task.eval.multipliers=[1]",
        )
    )
    assert out["config"]["task"]["optim"]["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "override", ["task.optim.lr=1e30", "seed=5", "model.dropout=0.3", "task.batch_size=8"]
)
def test_resume_refuses_settings_the_checkpoint_would_override(
    trained: Path, tmp_path: Path, override: str
) -> None:
    key = override.split("=")[0]
    with pytest.raises(CheckpointError, match=f"resume from .*\n  {key}: checkpoint"):
        train(
            compose_run(
                tmp_path,
                "encoder=rope",
                override,
                f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}",
            )
        )


def test_resume_may_train_longer_and_evaluate_otherwise(trained: Path, tmp_path: Path) -> None:
    out = train(
        compose_run(
            tmp_path,
            "encoder=rope",
            "trainer.max_steps=5",
            "task.eval.multipliers=[1,2]",
            f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}",
        )
    )
    assert out["train_steps"] == 5
    assert "test/ppl@32" in out["metrics"]


def test_a_run_continued_in_a_new_folder_tests_its_own_best_not_the_old_folders(
    tmp_path: Path,
) -> None:
    """Lightning restores the old folder's best path from the checkpoint; until the new run
    validates, testing it would evaluate the old run's weights under the new run's name."""
    from types import SimpleNamespace

    from pytorch_lightning.callbacks import ModelCheckpoint

    callback = ModelCheckpoint(dirpath=tmp_path / "new" / "checkpoints", filename="best")
    trainer = SimpleNamespace(checkpoint_callback=callback)
    callback.best_model_path = str(tmp_path / "old" / "checkpoints" / "best.ckpt")
    assert best_checkpoint(trainer) == ""  # the final weights are tested instead
    callback.best_model_path = str(tmp_path / "new" / "checkpoints" / "best.ckpt")
    assert best_checkpoint(trainer) == callback.best_model_path
    callback.best_model_path = ""
    assert best_checkpoint(trainer) == ""


def _damage(path: Path, offset: int, n: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * n)


def test_a_damaged_checkpoint_is_refused_naming_the_file(trained: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir()
    for name in ("last.ckpt", checkpoints.MANIFEST):
        (ckpt.parent / name).write_bytes((trained / "checkpoints" / name).read_bytes())
    checkpoints.verify(ckpt)  # an exact copy with its manifest verifies
    _damage(ckpt, ckpt.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"checkpoint {ckpt} is damaged: its sha256"):
        train(compose_run(tmp_path, "encoder=rope", f"ckpt_path={ckpt}"))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty \\(0 bytes\\)"),
        (b"not a checkpoint at all\n", "is not a readable posenc checkpoint"),
        (b"PK\x03\x04" + b"\0" * 100, "is not a readable posenc checkpoint"),
    ],
)
def test_unreadable_checkpoint_files_get_one_line_errors(
    tmp_path: Path, content: bytes, message: str
) -> None:
    ckpt = tmp_path / "given.ckpt"
    ckpt.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as err:
        train(compose_run(tmp_path, "eval_only=true", f"ckpt_path={ckpt}"))
    assert "weights_only=False" not in str(err.value)  # never suggest unsafe loading


def test_an_edited_tokenizer_cache_is_refused(tmp_path: Path) -> None:
    train(compose_run(tmp_path / "a", "encoder=none", "task.eval.multipliers=[1]"))
    cache = next((tmp_path / "a" / "cache").rglob("*.json"))
    payload = json.loads(cache.read_text())
    payload["chars"][1], payload["chars"][2] = payload["chars"][2], payload["chars"][1]
    cache.write_text(json.dumps(payload))  # same vocabulary size, other ids
    with pytest.raises(CacheError, match=f"cached tokenizer {cache} changed.*Delete"):
        train(
            compose_run(
                tmp_path / "b",
                "encoder=none",
                "task.eval.multipliers=[1]",
                f"paths.cache_dir={tmp_path / 'a' / 'cache'}",
            )
        )


def test_a_checkpoint_of_another_tokenizer_is_refused(trained: Path, tmp_path: Path) -> None:
    ckpt = torch.load(trained / "checkpoints" / "best.ckpt", weights_only=True)
    ckpt["posenc"]["tokenizer"] = "0" * 64
    other = tmp_path / "other.ckpt"
    torch.save(ckpt, other)
    with pytest.raises(CheckpointError, match="trained with tokenizer 000000000000"):
        train(compose_run(tmp_path, "encoder=rope", "eval_only=true", f"ckpt_path={other}"))


def test_a_failed_save_stops_the_run_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(obj: object, f: object, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(checkpoints.torch, "save", full_disk)
    with pytest.raises(
        CheckpointError,
        match=r"could not write checkpoint .*checkpoints/"
        r"(best|last)\.ckpt: File too large",
    ):
        train(
            compose_run(
                tmp_path, "encoder=rope", "trainer.max_steps=6", "checkpoint_every_n_steps=2"
            )
        )
    run = tmp_path / "run"
    assert not (run / "metrics.json").exists()
    assert not list((run / "checkpoints").glob(".*tmp*")), "a temporary file was left"


def test_save_atomic_names_an_unwritable_folder(tmp_path: Path) -> None:
    blocker = tmp_path / "checkpoints"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {blocker}/last.ckpt"):
        checkpoints.save_atomic({"state_dict": {}}, blocker / "last.ckpt")


def test_manifest_accepts_the_old_file_while_it_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    checkpoints.save_atomic({"state_dict": {"w": torch.zeros(2)}}, path)
    old = path.read_bytes()
    checkpoints.save_atomic({"state_dict": {"w": torch.ones(2)}}, path)
    manifest = json.loads((tmp_path / checkpoints.MANIFEST).read_text())
    assert manifest["last.ckpt"] == [checkpoints.sha256_file(path)]
    # A kill between the two manifest writes leaves the old file with both digests listed.
    new_digest = manifest["last.ckpt"][0]
    path.write_bytes(old)
    (tmp_path / checkpoints.MANIFEST).write_text(
        json.dumps({"last.ckpt": [new_digest, checkpoints.sha256_file(path)]})
    )
    checkpoints.verify(path)


def _command(run_dir: Path, cache: Path, *extra: str) -> list[str]:
    tiny = [o for o in TINY if not o.startswith(("trainer.max_steps", "trainer.val_check"))]
    return [
        sys.executable,
        "run.py",
        *tiny,
        "encoder=rope",
        "model.dropout=0.1",
        "trainer.max_steps=300",
        "trainer.val_check_interval=100",
        "checkpoint_every_n_steps=1000",
        "resume=true",
        f"hydra.run.dir={run_dir}",
        f"paths.cache_dir={cache}",
        *extra,
    ]


def _start_and_wait_for_training(run_dir: Path, cache: Path) -> subprocess.Popen:
    """:func:`_command` started in a process group of its own (as a terminal starts a
    job), once training has begun: its first validation wrote best.ckpt (step 100)."""
    proc = subprocess.Popen(
        _command(run_dir, cache),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while (
        not (run_dir / "checkpoints" / "best.ckpt").exists()
        and proc.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    return proc


def test_sigterm_saves_last_ckpt_exits_143_and_resumes_exactly(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    subprocess.run(_command(whole, cache), cwd=ROOT, check=True, capture_output=True, timeout=300)
    expected = json.loads((whole / "metrics.json").read_text())

    proc = _start_and_wait_for_training(stopped, cache)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    last = stopped / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=False)["global_step"]
    assert 100 <= step < 300, step
    assert "resume=true" in err and f"hydra.run.dir={stopped}" in err
    assert not (stopped / "metrics.json").exists()

    again = subprocess.run(
        _command(stopped, cache), cwd=ROOT, check=True, capture_output=True, text=True, timeout=300
    )
    # Lightning's warning that the folder it continues from is not empty: noise here
    assert "exists and is not empty" not in again.stderr, again.stderr[-2000:]
    resumed = json.loads((stopped / "metrics.json").read_text())
    assert resumed["train_steps"] == 300
    assert resumed["metrics"] == pytest.approx(expected["metrics"], rel=1e-6)
    names = sorted(p.name for p in (stopped / "checkpoints").iterdir())
    assert names == ["best.ckpt", "checksums.json", "last.ckpt"], names


@pytest.mark.skipif(
    signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None),
    reason="SIGTERM has a handler here that the in-process run would call",
)
def test_sigterm_during_a_validation_waits_for_its_end_and_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM that lands during a validation inside training: the validation finishes,
    training stops after it with ``last.ckpt`` saved at that step, and resuming gives the
    uninterrupted run's metrics. (Lightning's validation loop stopped at its next batch,
    where nothing is saved: the steps since the last ``best.ckpt`` were lost.)"""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    from posenc.tasks.lm import LMTask

    args = ("encoder=rope", "model.dropout=0.1", "trainer.max_steps=12")
    whole = train(compose_run(tmp_path / "whole", *args, "trainer.val_check_interval=3"))
    validate = LMTask.validation_step
    seen: list[int] = []

    def validation_step(self: LMTask, batch: object, batch_idx: int) -> None:
        if self.trainer.global_step == 6 and batch_idx == 0 and not self.trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.trainer.global_step == 6:
            seen.append(batch_idx)
        validate(self, batch, batch_idx)

    monkeypatch.setattr(LMTask, "validation_step", validation_step)
    with pytest.raises(SIGTERMException):
        train(compose_run(tmp_path / "stopped", *args, "trainer.val_check_interval=3"))
    assert len(seen) > 1, "the validation stopped at its first batch"
    last = tmp_path / "stopped" / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 6
    monkeypatch.setattr(LMTask, "validation_step", validate)
    resumed = train(
        compose_run(tmp_path / "stopped", *args, "trainer.val_check_interval=3", "resume=true")
    )
    assert resumed["train_steps"] == 12
    assert resumed["metrics"] == pytest.approx(whole["metrics"], rel=1e-6)


def test_ctrl_c_saves_last_ckpt_exits_130_and_prints_the_resume_command(tmp_path: Path) -> None:
    """SIGINT to the run's process group, as Ctrl-C in a terminal sends it: handled as
    SIGTERM (``last.ckpt`` saved between two steps, the command that continues the run
    printed, no traceback), exit status 130; the printed command finishes the run from
    that checkpoint. (Lightning turned the KeyboardInterrupt into exit status 1 with
    nothing saved.)"""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("SIGINT is ignored here, and so in the run this test starts")
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    proc = _start_and_wait_for_training(run_dir, cache)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, err[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=False)["global_step"]
    assert 100 <= step < 300, step
    assert not (run_dir / "metrics.json").exists()
    said = err.split(f"stopped by SIGINT; progress is saved in {last}. Continue with:\n", 1)
    assert len(said) == 2, err[-2000:]
    resume = said[1].splitlines()[0].split()
    assert resume[:2] == ["python", "run.py"] and resume[-2:] == [
        f"hydra.run.dir={run_dir}",
        "resume=true",
    ], resume
    subprocess.run([sys.executable, *resume[1:]], cwd=ROOT, check=True, capture_output=True)
    assert json.loads((run_dir / "metrics.json").read_text())["train_steps"] == 300
    log = (run_dir / "run.log").read_text()
    assert f"SIGINT at step {step}: saved {last}" in log and f"continuing from {last}" in log


def test_a_finished_run_resumed_keeps_its_validation_metrics(tmp_path: Path) -> None:
    """kill -9 during the final evaluation, then resume=true: training is over, the
    evaluation runs again, and metrics.json still has val/loss and val/ppl."""
    first = train(compose_run(tmp_path, "encoder=rope", "task.eval.multipliers=[1]"))
    (tmp_path / "run" / "metrics.json").unlink()  # as if killed before writing it
    again = train(compose_run(tmp_path, "encoder=rope", "task.eval.multipliers=[1]", "resume=true"))
    for key in ("val/loss", "val/ppl", "test/ppl@16"):
        assert again["metrics"][key] == pytest.approx(first["metrics"][key], rel=1e-9), key
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [
        "best.ckpt",
        "checksums.json",
        "last.ckpt",
    ]


def test_resume_takes_the_newer_of_last_and_a_slurm_requeue_checkpoint(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from posenc.training.rundir import resume_checkpoint

    cfg = OmegaConf.create({"eval_only": False, "ckpt_path": None, "resume": True})
    assert resume_checkpoint(cfg, tmp_path) is None  # nothing yet: start afresh
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    last.write_bytes(b"x")
    hpc = tmp_path / "hpc_ckpt_1.ckpt"
    hpc.write_bytes(b"x")
    os.utime(last, (1e9, 1e9))
    assert resume_checkpoint(cfg, tmp_path) == str(hpc)
    os.utime(hpc, (1e8, 1e8))
    assert resume_checkpoint(cfg, tmp_path) == str(last)
    assert resume_checkpoint(OmegaConf.merge(cfg, {"resume": False}), tmp_path) is None


@pytest.mark.parametrize(
    "message",
    [
        "[enforce fail at inline_container.cc:672] . unexpected pos 397184 vs 397072",
        "[enforce fail at inline_container.cc:747] . open file failed with strerror: "
        "Operation not permitted",
    ],
)
def test_a_write_torch_reports_as_runtime_error_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, message: str
) -> None:
    """torch.save reports a full disk, a file-size limit or a refused file as RuntimeError,
    not OSError (#38): the same one-line CheckpointError, and no temporary file left."""

    def failing(obj: object, f: str, *args: object, **kwargs: object) -> None:
        Path(f).write_bytes(b"x" * 1000)  # what a cut-short write leaves
        raise RuntimeError(message)

    monkeypatch.setattr(checkpoints.torch, "save", failing)
    path = tmp_path / "checkpoints" / "last.ckpt"
    cause = "the file was cut short" if "pos" in message else "cannot create the file"
    with pytest.raises(CheckpointError, match=f"could not write checkpoint {path}: {cause}"):
        checkpoints.save_atomic({"state_dict": {}}, path)
    assert list(path.parent.iterdir()) == []


def test_a_write_cut_short_on_a_full_disk_is_named_no_space_left_on_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch reports a full disk as RuntimeError ("unexpected pos"): with (almost) no room
    left on the folder's disk, the cause is named as the ENOSPC it is, with the file, so a
    sweep's error.json says "no space left on device" (it said "cut short", which a
    file-size limit does too)."""

    def failing(obj: object, f: str, *args: object, **kwargs: object) -> None:
        Path(f).write_bytes(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 9 vs 7")

    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255))  # f_bavail=0
    monkeypatch.setattr(checkpoints.torch, "save", failing)
    monkeypatch.setattr(checkpoints.os, "statvfs", lambda folder: full)
    path = tmp_path / "checkpoints" / "last.ckpt"
    with pytest.raises(
        CheckpointError, match=f"could not write checkpoint {path}: No space left on device"
    ) as caught:
        checkpoints.save_atomic({"state_dict": {}}, path)
    assert write_failure(caught.value) == f"no space left on device: {path}"
    assert list(path.parent.iterdir()) == []


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE as on Linux")
def test_a_checkpoint_past_a_file_size_limit_stops_the_run_with_one_line(tmp_path: Path) -> None:
    """A real run whose checkpoint cannot be written whole (a file-size limit below its
    size, as a full disk does): exit 2, one line naming the file, no traceback, no
    temporary file left behind (#38: torch's raw RuntimeError and a .ckpt.tmp file)."""
    import resource

    def limit() -> None:  # 40 KB: the logs fit, a checkpoint of this model (75 KB) does not
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    run = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "run.py"),
            *TINY,
            f"hydra.run.dir={run}",
            f"paths.cache_dir={tmp_path / 'cache'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: could not write checkpoint {run / 'checkpoints'}/"), last
    assert "the file was cut short (a full disk or a file-size limit" in last
    assert "Traceback" not in out.stderr
    assert not [p for p in run.rglob("*") if ".tmp" in p.name]


def test_a_checkpoint_naming_a_moved_source_resumes(tmp_path: Path) -> None:
    """#37 moved the parallel corpora to posenc/data/sources.py: a checkpoint whose config
    names the old path names the same function, and nothing else is forgiven."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        overrides = ["task=mt", f"paths.cache_dir={tmp_path}", f"paths.output_dir={tmp_path}"]
        cfg = compose("config", overrides=overrides)
    assert cfg.data.source._target_ == "posenc.data.sources.multi30k"
    old = OmegaConf.to_container(cfg, resolve=True)
    old.pop("hydra", None)
    old["data"]["source"]["_target_"] = "posenc.data.mt.multi30k"
    assert checkpoints.differences(old, cfg) == {}
    old["data"]["source"]["_target_"] = "posenc.data.mt.parallel_files"
    assert checkpoints.differences(old, cfg) == {
        "data.source._target_": (
            "posenc.data.sources.parallel_files",
            "posenc.data.sources.multi30k",
        )
    }


# -- tensors checked against the digests a checkpoint carries --------------------------


def _dense(ckpt: dict) -> tuple[str, torch.Tensor]:
    """The first optimiser-state tensor with no zero in it (its bytes occur once in the file)."""
    for i, state in ckpt["optimizer_states"][0]["state"].items():
        for key, t in state.items():
            if t.numel() >= 64 and bool((t != 0).all()):
                return f"optimizer_states.0.state.{i}.{key}", t
    raise AssertionError("no dense optimiser tensor")


def _flip(src: Path, dst: Path, tensor: torch.Tensor) -> None:
    """Copy ``src`` to ``dst`` with 64 bytes of ``tensor``'s data inverted in the file."""
    raw = bytearray(src.read_bytes())
    data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    at = bytes(raw).find(data)
    assert at >= 0 and bytes(raw).count(data) == 1
    for i in range(at, at + 64):
        raw[i] ^= 0xFF
    dst.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def flipped(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Copies of the run's checkpoints outside its folder (no checksums.json beside them),
    64 bytes flipped in a model weight (``model``) or an optimiser tensor (``optimizer``)."""
    out = tmp_path_factory.mktemp("elsewhere")
    best = trained / "checkpoints" / "best.ckpt"
    ckpt = torch.load(best, weights_only=True)
    _flip(best, out / "model.ckpt", ckpt["state_dict"]["model.embed.weight"])
    name, tensor = _dense(ckpt)
    _flip(best, out / "optimizer.ckpt", tensor)
    (out / "optimizer.name").write_text(name)
    return {"model": out / "model.ckpt", "optimizer": out / "optimizer.ckpt"}


def _refusal(path: Path, tensor: str) -> str:
    return re.escape(f"checkpoint {path} is damaged: tensor {tensor} does not match the digest")


def test_eval_only_refuses_a_copied_checkpoint_with_a_flipped_weight(
    flipped: dict[str, Path], tmp_path: Path
) -> None:
    """Outside its run folder no checksums.json covers the file: before the digests,
    torch.load took the flipped bytes and the run recorded ppl 2.6e+204 as the model's."""
    path = flipped["model"]
    assert not (path.parent / checkpoints.MANIFEST).exists()
    with pytest.raises(CheckpointError, match=_refusal(path, "state_dict.model.embed.weight")) as e:
        train(compose_run(tmp_path, "encoder=rope", "eval_only=true", f"ckpt_path={path}"))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_every_load_path_refuses_a_flipped_optimizer_tensor(
    flipped: dict[str, Path], tmp_path: Path
) -> None:
    """Resume (posenc's config check and Lightning's own load), init_from and eval_only
    all read the file through a check of every tensor, optimiser state included."""
    path = flipped["optimizer"]
    message = _refusal(path, (path.parent / "optimizer.name").read_text())
    with pytest.raises(CheckpointError, match=message):
        train(compose_run(tmp_path, "encoder=rope", f"ckpt_path={path}"))
    with pytest.raises(CheckpointError, match=message):
        checkpoints.VerifiedCheckpointIO().load_checkpoint(path)
    with pytest.raises(CheckpointError, match=message):
        train(compose_run(tmp_path / "init", "encoder=rope", f"init_from={path}"))
    assert not (tmp_path / "run" / "metrics.json").exists()
    assert not (tmp_path / "init" / "run" / "checkpoints").exists()


def test_generate_refuses_a_flipped_checkpoint_in_one_line(
    flipped: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from posenc import generate

    path = flipped["model"]
    assert generate.main([str(path), "--temperature", "0", "--tokens", "5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert re.match("posenc.generate: " + _refusal(path, "state_dict.model.embed.weight"), err)


def _without_digests(src: Path, dst: Path, edit: bool = False) -> None:
    """``src`` as an older posenc wrote it (no digests), optionally with 16 embedding
    values overflowed to 1e30."""
    ckpt = torch.load(src, weights_only=True)
    del ckpt[digests.KEY]
    if edit:
        ckpt["state_dict"]["model.embed.weight"][:4, :4] = 1e30
    torch.save(ckpt, dst)


def test_a_checkpoint_without_digests_loads_with_one_note(
    trained: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    best = trained / "checkpoints" / "best.ckpt"
    old = tmp_path / "old.ckpt"
    _without_digests(best, old)
    with caplog.at_level(logging.WARNING, logger=digests.__name__):
        first = checkpoints.load(old)
        checkpoints.VerifiedCheckpointIO().load_checkpoint(old)
    notes = [r.getMessage() for r in caplog.records if r.name == digests.__name__]
    assert notes == [f"{old} predates posenc's tensor digests: its tensors are loaded unchecked"]
    reference = checkpoints.load(best)
    assert torch.equal(first["state_dict"]["model.embed.weight"],
                       reference["state_dict"]["model.embed.weight"])  # fmt: skip


def test_a_resaved_checkpoint_keeping_the_old_digests_is_refused(
    trained: Path, tmp_path: Path
) -> None:
    """Weights edited and saved again with torch.save: the digests travel unchanged with
    the file, the tensors do not match them."""
    ckpt = torch.load(trained / "checkpoints" / "best.ckpt", weights_only=True)
    ckpt["state_dict"]["model.embed.weight"][:4, :4] = 1e30
    edited = tmp_path / "edited.ckpt"
    torch.save(ckpt, edited)
    with pytest.raises(CheckpointError, match=_refusal(edited, "state_dict.model.embed.weight")):
        checkpoints.load(edited)


def test_non_finite_results_are_recorded_and_drawn_without_a_traceback(
    trained: Path, tmp_path: Path
) -> None:
    """An older checkpoint (no digests) whose embedding overflows: the evaluation's inf
    perplexities are written as such, the figure leaves them out with a note (it died
    in matplotlib's "Data cannot be log-scaled" before), and the summary says inf."""
    old = tmp_path / "old.ckpt"
    _without_digests(trained / "checkpoints" / "best.ckpt", old, edit=True)
    out = train(
        compose_run(
            tmp_path, "encoder=rope", "eval_only=true", f"ckpt_path={old}",
            "task.eval.multipliers=[1,2]",
        )
    )  # fmt: skip
    ppl = {k: v for k, v in out["metrics"].items() if k.startswith("test/ppl")}
    assert len(ppl) == 4 and all(math.isinf(v) for v in ppl.values()), ppl
    text = (tmp_path / "run" / "metrics.json").read_text()
    assert json.loads(text)["metrics"]["test/ppl@16"] == math.inf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert "test/ppl_vs_length" in events.Tags()["images"]
