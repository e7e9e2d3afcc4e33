"""Bad input found after the config pass (a data file, a checkpoint, the training itself)
is a :class:`~posenc.errors.UserError`: one line naming the file or key and the fix, exit
status 2, no traceback (#38). The cases run in-process (they fail before any model is
built); three real ``run.py`` processes show the whole path to the terminal."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posenc.errors import UserError
from posenc.train import train
from tests.conftest import ROOT, TINY, compose_run
from tests.tasks.test_mt_job import compose_mt

TEXT = "To be, or not to be, that is the question.\n" * 40


def _files(tmp_path: Path, **files: bytes | None) -> dict[str, Path]:
    """Write ``name=bytes`` into ``tmp_path`` (``None``: a directory of that name)."""
    out = {}
    for name, data in files.items():
        path = tmp_path / name.replace("_", ".")
        if data is None:
            path.mkdir()
        else:
            path.write_bytes(data)
        out[name] = path
    return out


def _text_files(tmp_path: Path, train: bytes | None, val: bytes = TEXT.encode()) -> list[str]:
    f = _files(tmp_path, train_txt=train, val_txt=val, test_txt=TEXT.encode())
    return [
        "data=text_files",
        *[f"data.source.{s}={f[f'{s}_txt']}" for s in ("train", "val", "test")],
    ]


CASES = {
    "empty": (b"", r"train\.txt is empty; expected UTF-8 text"),
    "whitespace": (b"  \n\n \t", r"the 'train' file '.*train\.txt' holds only whitespace"),
    "not utf-8": (b"caf\xe9 au lait\n" * 50, r"train\.txt is not valid UTF-8: byte offset 3"),
    "too short": (b"hi\n", r"the train split has 3 tokens, fewer than seq_len \+ 1 = 17"),
    "a directory": (None, r"the 'train' file '.*train\.txt' is a directory, not a file"),
}


@pytest.mark.parametrize("case", CASES)
def test_an_unusable_text_file_is_a_user_error(tmp_path: Path, case: str) -> None:
    data, message = CASES[case]
    with pytest.raises(UserError, match=message):
        train(compose_run(tmp_path, *_text_files(tmp_path, data)))


def test_a_missing_file_and_a_corrupt_gzip_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(
        UserError,
        match=r"'train' file '.*nope\.txt' does not exist; fix "
        r"data\.source\.train",
    ):
        train(
            compose_run(
                tmp_path,
                "data=text_files",
                f"data.source.train={tmp_path}/nope.txt",
                f"data.source.val={tmp_path}/nope.txt",
                f"data.source.test={tmp_path}/nope.txt",
            )
        )
    cut = tmp_path / "cut.gz"
    cut.write_bytes(gzip.compress(TEXT.encode() * 50)[:200])
    with pytest.raises(UserError, match=r"cut\.gz is not a complete gzip file"):
        train(
            compose_run(
                tmp_path,
                "data=text_files",
                f"data.source.train={cut}",
                f"data.source.val={cut}",
                "task.eval.splits=[val]",
            )
        )


def test_lengths_the_split_cannot_fill_are_user_errors(tmp_path: Path) -> None:
    short_val = _text_files(tmp_path, TEXT.encode(), val=b"only a few words here\n")
    with pytest.raises(
        UserError,
        match=r"the 'val' split has \d+ tokens, too few for one evaluation window of "
        r"length L=64 \(needs 65\); drop 4 from task.eval.multipliers \(L = 4 x "
        r"task.seq_len\), or lower task.seq_len \(now 16\), or use a longer split\.$",
    ):
        train(compose_run(tmp_path, *short_val, "task.eval.splits=[val]"))
    # The training length itself: the key to change is task.seq_len, which the user set.
    with pytest.raises(
        UserError,
        match=r"length L=30 \(needs 31\); lower task.seq_len \(now 30\), or use a longer",
    ):
        train(compose_run(tmp_path, *short_val, "task.seq_len=30", "task.eval.multipliers=[1]"))
    with pytest.raises(UserError, match=r"splits must sum to 1, got \(0\.5, 0\.2, 0\.2\)"):
        train(compose_run(tmp_path, "data.source.splits=[0.5,0.2,0.2]"))


def test_a_missing_checkpoint_names_those_its_folder_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run shorter than its validation interval has last.ckpt but no best.ckpt: giving
    best.ckpt (as the README's commands do) names the one that exists."""
    from posenc import generate
    from posenc.config import ConfigError

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / "last.ckpt").write_bytes(b"x")
    best = folder / "best.ckpt"
    with pytest.raises(ConfigError) as err:
        train(compose_run(tmp_path, "eval_only=true", f"ckpt_path={best}"))
    assert err.value.problems == [
        f"ckpt_path={best}: no such file; {folder} holds last.ckpt: give "
        f"ckpt_path={folder / 'last.ckpt'}"
    ]
    assert generate.main([str(best)]) == 2
    assert capsys.readouterr().err == (
        f"posenc.generate: {best}: no such file; {folder} holds last.ckpt: give "
        f"{folder / 'last.ckpt'}\n"
    )
    # the run's folder, or its checkpoints folder, names the checkpoint in it
    for given in (folder.parent, folder):
        with pytest.raises(ConfigError) as err:
            train(compose_run(tmp_path, f"init_from={given}"))
        assert err.value.problems == [
            f"init_from={given}: is a folder, not a checkpoint file; {folder} holds "
            f"last.ckpt: give init_from={folder / 'last.ckpt'}"
        ]
    assert generate.main([str(tmp_path)]) == 2
    assert (
        capsys.readouterr().err
        == f"posenc.generate: {tmp_path}: is a folder, not a checkpoint file\n"
    )


def test_parallel_files_of_unequal_length_are_a_user_error(tmp_path: Path) -> None:
    f = _files(tmp_path, src_txt=b"a b c\n" * 10, tgt_txt=b"x y z\n" * 9)
    files = [
        f"data.source.{k}={f[v]}"
        for k, v in (
            ("train_src", "src_txt"),
            ("train_tgt", "tgt_txt"),
            ("val_src", "src_txt"),
            ("val_tgt", "tgt_txt"),
        )
    ]
    with pytest.raises(
        UserError,
        match=r"parallel files differ in line count: .*src\.txt has "
        r"10 lines but .*tgt\.txt has 9",
    ):
        train(
            compose_mt(
                tmp_path / "run",
                tmp_path / "cache",
                "data=parallel_files",
                *files,
                "task.eval_split=val",
            )
        )


def own_text(**_: object) -> dict[str, str]:
    """A text source of one's own without a test split: only loading it tells (the
    arguments of the source it stands in for are ignored)."""
    return {"train": TEXT * 4, "val": TEXT}


def own_pairs(**_: object) -> dict[str, tuple[list[str], list[str]]]:
    """A parallel source of one's own without a test split (Shakespeare's lines to
    themselves: enough text for the tokenizer)."""
    data = Path(os.environ["POSENC_DATA_DIR"]) / "tinyshakespeare" / "input.txt"
    lines = [line for line in data.read_text().splitlines()[:3000] if line]
    return {"train": (lines, lines), "val": (lines[:8], lines[:8])}


def _own_source(name: str) -> list[str]:
    return [f"data.source._target_={__name__}.{name}", "data.name=mine"]


def test_a_split_the_loaded_data_lacks_is_refused_before_training(tmp_path: Path) -> None:
    """The test split is never stood in for by another; a source that says what it has
    only once read is checked as soon as it is, before any training."""
    with pytest.raises(UserError) as err:
        train(compose_run(tmp_path, *_own_source("own_text")))
    assert str(err.value).splitlines()[1:] == [
        "  task.eval.splits contains 'test': data=mine has no test split (the source gave "
        "train, val); give it one, or set task.eval.splits=[val]"
    ]
    run = tmp_path / "run"
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()
    mt = _own_source("own_pairs")
    with pytest.raises(UserError) as err:
        train(compose_mt(run, tmp_path / "cache", *mt))
    assert str(err.value).splitlines()[1:] == [
        "  task.eval_split='test': data=mine has no test split (the source gave train, val); "
        "give it one, or set task.eval_split=val"
    ]
    assert not (run / "checkpoints").exists() and not (run / "metrics.json").exists()
    metrics = train(compose_mt(run, tmp_path / "cache", *mt, "task.eval_split=val"))["metrics"]
    assert "val/bleu" in metrics and not any(k.startswith("test/bleu") for k in metrics)


def test_a_data_file_with_another_checksum_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data" / "tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data" / "tinyshakespeare" / "input.txt").write_text(TEXT)
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(
        UserError,
        match=r"input\.txt \(tinyshakespeare/input\.txt\) is corrupt "
        r"or a different version: expected sha256 86c4e6aa",
    ):
        train(compose_run(tmp_path))


def _run(cwd: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess[str]:
    flags = ["-m"] if multirun else []
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *flags, *TINY, *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr + out.stdout
    return out.stderr.strip().splitlines()[-1]


def test_a_missing_data_file_reaches_the_terminal_as_one_line(tmp_path: Path) -> None:
    line = _one_line(
        _run(
            tmp_path,
            "data=text_files",
            "data.source.train=a.txt",
            "data.source.val=a.txt",
            "data.source.test=a.txt",
        )
    )
    assert line == (
        "error: text_files: the 'train' file 'a.txt' does not exist; fix "
        "data.source.train in your configuration."
    )


def test_a_diverging_loss_reaches_the_terminal_as_one_line(tmp_path: Path) -> None:
    line = _one_line(
        _run(
            tmp_path,
            "task.optim.lr=1e30",
            "trainer.gradient_clip_val=null",
            "trainer.max_steps=20",
            "task.optim.warmup_steps=1",
            f"paths.cache_dir={tmp_path / 'cache'}",
        )
    )
    assert line.startswith("error: training loss is ") and "Lower task.optim.lr" in line


def test_an_unwritable_run_directory_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        line = _one_line(
            _run(tmp_path, f"{key}={tmp_path / 'a_file' / 'run'}", multirun="sweep" in key)
        )
        assert line == (
            f"error: {key}={tmp_path / 'a_file' / 'run'}: cannot create or write "
            f"this folder (Not a directory); pick another {key}, or make it writable"
        )
