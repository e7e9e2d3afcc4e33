"""A refused run changes nothing of another run's files, and bad input in a real
``run.py`` is one message with exit status 2, no traceback (#27 points 2 and 11)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posenc.errors import CheckpointError, RunDirError
from posenc.train import train
from posenc.training.rundir import (
    RESERVE,
    RESERVE_BYTES,
    RUN_FILES,
    space_for_error_record,
    write_failure,
    write_into_reserve,
    write_json_atomic,
)
from tests.conftest import ROOT, TINY, compose_run


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *TINY, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_refused_run_leaves_the_finished_runs_files_byte_identical(tmp_path: Path) -> None:
    run = tmp_path / "finished"
    cache = f"paths.cache_dir={tmp_path / 'cache'}"
    done = _run(tmp_path, "encoder=rope", f"hydra.run.dir={run}", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "run.log").is_file()
    before = _snapshot(run)
    ckpt = run / "checkpoints" / "best.ckpt"
    for refused in (
        _run(tmp_path, "encoder=alibi", "model.d_model=32", f"hydra.run.dir={run}", cache),
        _run(
            tmp_path,
            "encoder=rope",
            "eval_only=true",
            f"ckpt_path={ckpt}",
            f"hydra.run.dir={run}",
            cache,
        ),
    ):
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "never overwrites results" in refused.stderr
        assert "Traceback" not in refused.stderr + refused.stdout
    assert _snapshot(run) == before


def test_bad_input_is_one_message_without_a_traceback(tmp_path: Path) -> None:
    out = _run(tmp_path, "seed=-1", "task.seq_len=0")
    assert out.returncode == 2
    assert out.stderr.splitlines()[:3] == [
        "error: invalid config (2 problems):",
        "  seed=-1: must be an integer >= 0",
        "  task.seq_len=0: must be a positive integer",
    ]
    assert "Traceback" not in out.stderr + out.stdout
    # Nothing was written, and the run directory Hydra made for it is gone again.
    assert not list((tmp_path / "outputs").rglob("*_seed0_*"))


def test_a_run_refused_after_its_record_is_written_leaves_no_folder(tmp_path: Path) -> None:
    """A checkpoint of another model is refused once the run has written its job record and
    log: the folder goes again (the report would list it as a run killed early), while a
    folder that held a run's files before keeps them."""
    cache = f"paths.cache_dir={tmp_path / 'cache'}"
    done = _run(tmp_path, "encoder=rope", f"hydra.run.dir={tmp_path / 'trained'}", cache)
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = tmp_path / "trained" / "checkpoints" / "best.ckpt"
    fresh, crashed = tmp_path / "fresh", tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "run.log").write_text("a crashed run's log\n")
    for folder, extra in ((fresh, []), (crashed, ["resume=true"])):
        refused = _run(
            tmp_path, "encoder=alibi", "eval_only=true", f"ckpt_path={ckpt}",
            f"hydra.run.dir={folder}", cache, *extra,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "encoder: checkpoint 'rope', config 'alibi'" in refused.stderr
    assert not fresh.exists()
    assert (crashed / "run.log").read_text().startswith("a crashed run's log")


@pytest.mark.parametrize("leftover", RUN_FILES)
def test_a_directory_with_another_runs_files_is_refused_unless_resuming(
    tmp_path: Path, leftover: str
) -> None:
    """A crashed run's directory (no checkpoint yet) is refused to a new run, and taken
    by the same command with resume=true (it then starts afresh)."""
    run = tmp_path / "run"
    run.mkdir()
    if "." in leftover[1:]:  # run.log, error.json
        (run / leftover).write_text("from an earlier run\n")
    else:  # .hydra, tb
        (run / leftover).mkdir()
    with pytest.raises(RunDirError, match=f"already holds another run's files \\({leftover}"):
        train(compose_run(tmp_path, "encoder=none"))
    out = train(compose_run(tmp_path, "encoder=none", "resume=true", "task.eval.multipliers=[1]"))
    assert out["train_steps"] == 3


def test_a_misspelled_key_gets_the_nearest_key(tmp_path: Path) -> None:
    from posenc.preflight import misspelled_keys

    conf = ROOT / "conf"
    assert misspelled_keys(["model.d_modle=64", "task=mt", "task.optim.lrr=1"], conf) == [
        "model.d_modle: no such key; did you mean model.d_model?",
        "task.optim.lrr: no such key; did you mean task.optim.lr?",
    ]
    # Sweeps take their first choice; a key of the chosen encoder is known. (run.py passes
    # the words without flags such as -m.)
    assert misspelled_keys(["encoder=rope,alibi", "encoder.base=500", "seed=0,1"], conf) == []
    assert misspelled_keys(["encoder=shaw", "encoder.max_distnce=4"], conf) == [
        "encoder.max_distnce: no such key; did you mean encoder.max_distance?"
    ]
    # A group added with + (a sweep's arms are variants), on the command line or in the
    # preset's grid, is composed too: fox's own option is known, a misspelling is not.
    fox = ["sweep=algo_length", "+variant=fox", "encoder.bias_init=spread"]
    assert misspelled_keys(fox, conf) == []
    assert misspelled_keys([*fox[:2], "encoder.bias_initt=spread"], conf) == [
        "encoder.bias_initt: no such key; did you mean encoder.bias_init?"
    ]
    assert misspelled_keys(["sweep=algo_length", "encoder.bias_init=spread"], conf) == [
        "encoder.bias_init: no such key; encoder has _partial_, _target_"  # none's, the first arm
    ]
    # A key the config has, added with + (an older command line): one line with the fix.
    assert misspelled_keys(["+trainer.accumulate_grad_batches=2", "+variant=fox"], conf) == [
        "+trainer.accumulate_grad_batches: trainer.accumulate_grad_batches is already in the "
        "config; set it without the +: trainer.accumulate_grad_batches=2"
    ]
    assert misspelled_keys(["+trainer.detect_anomaly=true", "++trainer.max_steps=4"], conf) == []
    # What Hydra itself reports better (bad syntax, unknown groups) is left to it.
    assert misspelled_keys(["model.d_model=[", "encoder=nope"], conf) == []
    out = _run(tmp_path, "model.d_modle=64")
    assert out.returncode == 2 and "did you mean model.d_model?" in out.stderr
    assert "Traceback" not in out.stderr


def test_keys_that_must_be_set_are_known_keys() -> None:
    """``???`` keys (a DictConfig says they are not "in" it) are the ones a user must set:
    the README's own-data commands were refused as misspelled (#38)."""
    from posenc.preflight import misspelled_keys

    conf = ROOT / "conf"
    assert (
        misspelled_keys(
            ["data=text_files", "data.source.train=a.txt", "data.source.val=b.txt"], conf
        )
        == []
    )
    assert (
        misspelled_keys(
            [
                "task=mt",
                "data=parallel_files",
                "data.source.train_src=a",
                "data.source.train_tgt=b",
                "data.source.val_src=c",
                "data.source.val_tgt=d",
            ],
            conf,
        )
        == []
    )
    assert misspelled_keys(["data=text_files", "data.source.trian=a.txt"], conf) == [
        "data.source.trian: no such key; did you mean data.source.train?"
    ]
    # A sweep preset's own grid picks the task: its keys are known keys (#38).
    assert misspelled_keys(["sweep=mt_length", "task.max_len=64"], conf) == []
    assert misspelled_keys(["sweep=mt_length", "task.max_lne=64"], conf) == [
        "task.max_lne: no such key; did you mean task.max_len?"
    ]
    # A key below a group the task lacks, or below a group that is null (off): Hydra's
    # "Could not override" over several lines.
    assert misspelled_keys(
        ["task=mt", "task.eval.multipliers=[1]", "task.decod.beam_size=2"], conf
    ) == [
        "task.eval.multipliers: no such key; task has decode, eval_max_sentences, eval_split, "
        "label_smoothing, learned, length_buckets, max_len, max_tokens, max_train_src_len, "
        "monitor, monitor_mode, name, optim, samples, share_embeddings, val_bleu_sentences",
        "task.decod.beam_size: no such key; did you mean task.decode?",
    ]
    assert misspelled_keys(["task.learned.threshold=3"], conf) == [
        "task.learned.threshold: task.learned is null here (off), so it has no threshold; give "
        "the whole group, e.g. task.learned={threshold: 3, ...} with each of its keys"
    ]
    assert misspelled_keys(["task=algo", "task.learned.threshold=3"], conf) == []
    # A misspelled group or top-level key: Hydra's "not in struct" named no alternative.
    assert misspelled_keys(["encodr=rope", "seeed=1", "seed=2"], conf) == [
        "encodr: no such key or config group; did you mean encoder?",
        "seeed: no such key or config group; did you mean seed?",
    ]


# ---- writes on a full disk ---------------------------------------------------------------------
def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on a new file is created but nothing fits in it (ENOSPC), as on a full disk."""

    def write_text(self: Path, *args: object, **kwargs: object) -> int:
        self.touch()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", write_text)


def test_a_write_that_fails_on_a_full_disk_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(An empty ``.error.json.tmp<pid>`` stayed in each job folder of a sweep on a full disk.)"""
    (tmp_path / "error.json").write_text("{}")  # what was there stays as it was
    _disk_full(monkeypatch)
    with pytest.raises(OSError, match="No space left on device"):
        write_json_atomic(tmp_path / "error.json", {"message": "x"})
    assert os.listdir(tmp_path) == ["error.json"]
    assert (tmp_path / "error.json").read_bytes() == b"{}"


def test_the_space_held_back_takes_the_error_record_when_the_disk_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep job holds RESERVE_BYTES of disk back; on a full disk its error record is
    written into those blocks (a too-long traceback keeps its end), the file renamed to
    error.json, nothing else left; a job that needed none gives the space back."""
    with space_for_error_record(tmp_path):
        held = tmp_path / RESERVE
        assert held.stat().st_size == RESERVE_BYTES
        assert held.stat().st_blocks * 512 >= RESERVE_BYTES  # blocks given, not a sparse file
    assert os.listdir(tmp_path) == []

    traceback = "Traceback (most recent call last):\n" + "  frame\n" * 20_000 + "OSError: full\n"
    record = {"error_type": "CheckpointError", "message": "m", "traceback": traceback}
    with space_for_error_record(tmp_path):
        _disk_full(monkeypatch)
        write_into_reserve(tmp_path / "error.json", record)
    assert os.listdir(tmp_path) == ["error.json"]
    assert (tmp_path / "error.json").stat().st_size <= RESERVE_BYTES
    written = json.loads((tmp_path / "error.json").read_text())
    assert written["message"] == "m" and written["traceback"].endswith("  frame\nOSError: full\n")
    assert len(written["traceback"]) < len(traceback)


def test_write_failure_names_the_cause_and_the_file() -> None:
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/a/checkpoints/last.ckpt")
    try:
        try:
            raise full
        except OSError as err:
            raise CheckpointError("could not write checkpoint") from err
    except CheckpointError as err:
        assert write_failure(err) == "no space left on device: /runs/a/checkpoints/last.ckpt"
    assert write_failure(RuntimeError("a bug")) is None
    assert write_failure(OSError(errno.EDQUOT, "Disk quota exceeded")) == "disk quota exceeded"
