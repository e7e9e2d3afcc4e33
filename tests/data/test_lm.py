"""Tests for the LM sources, the evaluation windows and LMDataModule."""

from __future__ import annotations

import functools
import gzip
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from posenc.data.download import data_dir
from posenc.data.lm import (
    EvalWindows,
    LMDataModule,
    cached_ids,
    encode_split,
    eval_stream_length,
    first_scored,
    score_masks,
    window_starts,
)
from posenc.data.sources import text_files, tinyshakespeare, wikitext103
from posenc.data.tokenizers import CharTokenizer, build_tokenizer
from posenc.errors import DataError

# (n_tokens, length, stride): strides dividing and not dividing L, stride == L with and without
# a partial tail, stride 1, and streams holding exactly one window.
COMBOS = [
    (17, 4, 4),
    (23, 4, 4),
    (100, 8, 3),
    (101, 8, 8),
    (100, 8, 8),
    (60, 16, 1),
    (9, 8, 8),
    (9, 8, 1),
    (1025, 64, 16),
    (37, 5, 2),
    (200, 7, 6),
]


def _scored_positions(n: int, length: int, stride: int) -> tuple[torch.Tensor, list[int]]:
    """How often each stream position is scored, and the windows' starts."""
    starts = window_starts(n, length, stride)
    masks = score_masks(starts, length)
    counts = torch.zeros(n, dtype=torch.long)
    for s, mask in zip(starts, masks, strict=True):
        targets = torch.arange(s + 1, s + length + 1)
        counts.index_add_(0, targets[mask], torch.ones(int(mask.sum()), dtype=torch.long))
    return counts, starts


@pytest.mark.parametrize(("n", "length", "stride"), COMBOS)
def test_every_target_scored_exactly_once(n: int, length: int, stride: int) -> None:
    counts, starts = _scored_positions(n, length, stride)
    assert counts[0] == 0  # the first token is never a target
    assert torch.equal(counts[1:], torch.ones(n - 1, dtype=torch.long))
    assert starts[0] == 0 and starts[-1] + length == n - 1  # last window ends at the stream end
    assert all(b - a <= stride for a, b in zip(starts, starts[1:], strict=False))


@pytest.mark.parametrize(("n", "length", "stride"), COMBOS)
def test_sliding_scored_tokens_have_enough_context(n: int, length: int, stride: int) -> None:
    starts = window_starts(n, length, stride)
    masks = score_masks(starts, length)
    assert bool(masks[0].all())  # the first window scores all of its targets
    for mask in masks[1:]:
        scored = torch.nonzero(mask).flatten()
        # Target j of a window is predicted from j + 1 tokens of that window.
        assert int(scored.min()) + 1 >= length - stride + 1
        assert len(scored) <= stride and bool(mask[-1])
        # Scored targets form one block at the end of the window.
        assert torch.equal(scored, torch.arange(length - len(scored), length))


def test_stride_equal_to_length_is_non_overlapping() -> None:
    assert window_starts(33, 8, 8) == [0, 8, 16, 24]
    assert bool(score_masks([0, 8, 16, 24], 8).all())
    assert window_starts(21, 4, 3) == [0, 3, 6, 9, 12, 15, 16]
    assert first_scored([0, 3, 6, 9, 12, 15, 16], 4) == [0, 1, 1, 1, 1, 1, 3]


def test_window_helpers_reject_bad_input() -> None:
    with pytest.raises(ValueError, match=r"stride must be in \[1, length=8\].*got 9"):
        window_starts(100, 8, 9)
    with pytest.raises(ValueError, match="got 0"):
        window_starts(100, 8, 0)
    with pytest.raises(ValueError, match="needs 9 tokens, the stream has 8"):
        window_starts(8, 8, 8)
    with pytest.raises(ValueError, match="at most 4 apart"):
        first_scored([0, 5], 4)


def test_eval_stream_length_caps_to_whole_windows() -> None:
    assert eval_stream_length(1000, 64, None) == 1 + 15 * 64
    assert eval_stream_length(1000, 64, 200) == 1 + 3 * 64
    assert eval_stream_length(1000, 64, 10) == 65  # a tiny cap still gives one full window
    assert eval_stream_length(64, 64, None) == 0


def test_non_overlapping_windows_reproduce_the_stream() -> None:
    tokens = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(0))
    n = eval_stream_length(tokens.numel(), 32, None)
    ds = EvalWindows(tokens[:n], 32, 32)
    items = [ds[i] for i in range(len(ds))]
    inputs = torch.cat([it["input"] for it in items])
    targets = torch.cat([it["target"] for it in items])
    assert torch.equal(inputs, tokens[: n - 1]) and torch.equal(targets, tokens[1:n])
    assert all(bool(it["loss_mask"].all()) for it in items)


# ---------------------------------------------------------------------------- data module


@pytest.fixture(scope="module")
def shakespeare() -> str:
    path = data_dir() / "tinyshakespeare/input.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found; set POSENC_DATA_DIR")
    return path.read_text(encoding="utf-8")


def _small_source(text: str) -> dict[str, str]:
    return {"train": text[:50_000], "val": text[50_000:60_000], "test": text[60_000:65_000]}


def _module(text: str, cache: Path, **overrides: Any) -> LMDataModule:
    kwargs: dict[str, Any] = {
        "source": functools.partial(_small_source, text),
        "tokenizer": {"kind": "char"},
        "cache_dir": cache,
        "seq_len": 16,
        "batch_size": 4,
        "eval_batch_size": 3,
        "eval_lengths": [16, 64, 256],  # 1x, 4x, 16x the training length
        "sliding_stride": 8,
        "eval_max_tokens": 1000,
        "train_steps_per_epoch": 5,
        "seed": 0,
    }
    kwargs.update(overrides)
    dm = LMDataModule(**kwargs)
    dm.setup("fit")
    return dm


def _first_batches(dm: LMDataModule, k: int = 3) -> list[dict[str, torch.Tensor]]:
    it = iter(dm.train_dataloader())
    return [next(it) for _ in range(k)]


def test_train_batches_are_seeded_random_crops(shakespeare: str, tmp_path: Path) -> None:
    dm = _module(shakespeare, tmp_path)
    a = _first_batches(dm)
    b = _first_batches(_module(shakespeare, tmp_path))
    c = _first_batches(_module(shakespeare, tmp_path, seed=1))
    assert all(torch.equal(x["input"], y["input"]) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x["input"], y["input"]) for x, y in zip(a, c, strict=True))
    loader = dm.train_dataloader()
    assert len(loader) == 5
    # Step s's batch depends only on (seed, s): an iteration that starts at step 2 (a
    # resumed run) yields what an uninterrupted one yields as its third batch.
    loader.sampler.progress = lambda: (2, 1)  # two optimizer steps, no accumulation
    resumed = iter(loader)
    assert torch.equal(next(resumed)["input"], a[2]["input"])
    assert not torch.equal(next(resumed)["input"], a[2]["input"])

    train = dm.lm_split_tokens("train")
    windows = train.unfold(0, 17, 1)  # every length-17 crop of the train stream
    for batch in a:
        assert batch["input"].shape == (4, 16) and batch["input"].dtype == torch.long
        for x, y in zip(batch["input"], batch["target"], strict=True):
            row = torch.cat([x, y[-1:]])
            assert torch.equal(x[1:], y[:-1])
            assert bool((windows == row).all(dim=1).any())  # a real contiguous crop


def test_eval_windows_at_16x_are_full_length(shakespeare: str, tmp_path: Path) -> None:
    dm = _module(shakespeare, tmp_path)
    loaders = dm.eval_dataloaders("test")
    assert list(loaders) == ["ppl@16", "ppl_sw@16", "ppl@64", "ppl_sw@64", "ppl@256", "ppl_sw@256"]
    stream = dm.lm_split_tokens("test")
    for L in (16, 64, 256):
        n = eval_stream_length(stream.numel(), L, 1000)
        totals = {}
        for name in (f"ppl@{L}", f"ppl_sw@{L}"):
            batches = list(loaders[name])
            for batch in batches:
                assert batch["input"].shape[1] == L and batch["target"].shape[1] == L
                assert batch["loss_mask"].dtype == torch.bool
                assert torch.equal(batch["input"][:, 1:], batch["target"][:, :-1])
            totals[name] = sum(int(b["loss_mask"].sum()) for b in batches)
            last = batches[-1]["target"][-1]
            assert torch.equal(last, stream[n - L : n])  # windows end where the cap says
        # Both protocols score the same tokens: every target of the capped stream once.
        assert totals[f"ppl@{L}"] == totals[f"ppl_sw@{L}"] == n - 1
    # The cap of 1000 tokens keeps 3 whole windows at 256 (768 scored tokens).
    assert len(loaders["ppl@256"].dataset) == 3
    assert len(loaders["ppl_sw@256"].dataset) == 1 + (768 - 256) // 8

    val = next(iter(dm.val_dataloader()))
    assert val["input"].shape == (3, 16) and bool(val["loss_mask"].all())


def test_eval_without_cap_covers_the_whole_split(shakespeare: str, tmp_path: Path) -> None:
    dm = _module(shakespeare, tmp_path, eval_max_tokens=None, sliding_stride=None)
    loaders = dm.eval_dataloaders("val")
    assert list(loaders) == ["ppl@16", "ppl@64", "ppl@256"]
    n = dm.lm_split_tokens("val").numel()
    assert n == 10_000  # char-level: one token per character
    assert len(loaders["ppl@256"].dataset) == (n - 1) // 256


def test_split_too_short_for_an_eval_length(shakespeare: str, tmp_path: Path) -> None:
    def short() -> dict[str, str]:
        return {"train": shakespeare[:5000], "val": shakespeare[5000:5100], "test": "x" * 500}

    with pytest.raises(ValueError, match=r"'val' split has 100 tokens.*L=256"):
        _module(shakespeare, tmp_path, source=short)


def test_module_accessors_and_argument_errors(shakespeare: str, tmp_path: Path) -> None:
    dm = LMDataModule(
        source=functools.partial(_small_source, shakespeare),
        tokenizer={"kind": "char"},
        cache_dir=tmp_path,
        seq_len=16,
        batch_size=4,
    )
    with pytest.raises(RuntimeError, match="call setup"):
        _ = dm.vocab_size
    dm.setup()
    assert dm.eval_lengths == [16] and dm.eval_batch_size == 4
    assert dm.vocab_size == dm.tokenizer.vocab_size
    assert dm.tokenizer.decode(dm.lm_split_tokens("val").tolist()) == shakespeare[50_000:60_000]
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        dm.lm_split_tokens("dev")
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        LMDataModule(
            source=dict, tokenizer={"kind": "char"}, cache_dir=tmp_path, seq_len=0, batch_size=1
        )
    with pytest.raises(ValueError, match="'kind'"):
        LMDataModule(source=dict, tokenizer={}, cache_dir=tmp_path, seq_len=4, batch_size=1)
    bad = LMDataModule(
        source=lambda: {"train": "abc"},
        tokenizer={"kind": "char"},
        cache_dir=tmp_path,
        seq_len=2,
        batch_size=1,
    )
    with pytest.raises(ValueError, match=r"no text for splits \['val'\]"):
        bad.setup()


def test_module_with_bpe_on_real_tinyshakespeare(shakespeare: str, tmp_path: Path) -> None:
    dm = LMDataModule(
        source=functools.partial(tinyshakespeare, splits=(0.9, 0.1, 0.0)),
        tokenizer={"kind": "bpe", "vocab_size": 300},
        cache_dir=tmp_path,
        seq_len=32,
        batch_size=2,
        eval_lengths=[32, 512],
        sliding_stride=16,
        eval_max_tokens=2048,
    )
    dm.setup()
    assert dm.vocab_size == 300
    # nanoGPT's 90/10 split has no test part, and none is made up
    assert dm.splits == ("train", "val")
    with pytest.raises(ValueError, match=r"unknown split 'test'; this data has \['train', 'val'\]"):
        dm.lm_split_tokens("test")
    batch = next(iter(dm.eval_dataloaders("val")["ppl_sw@512"]))
    assert batch["input"].shape == (2, 512) and int(batch["input"].max()) < 300


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_a_split_encoded_in_chunks_equals_it_encoded_whole(
    shakespeare: str, tmp_path: Path, kind: str
) -> None:
    # pieces cut after a newline, some empty lines and a text without a final newline
    text = shakespeare[:3000] + "\n\n\nend"
    settings = {"vocab_size": 200} if kind == "bpe" else {}
    tok = build_tokenizer(kind, [shakespeare[:20_000]], tmp_path, **settings)
    whole = tok.encode(text)
    pieces: list[str] = []
    encode = tok.encode
    tok.encode = lambda t: pieces.append(t) or encode(t)  # type: ignore[method-assign]
    for chunk in (1, 7, 100, 2999):
        assert encode_split(tok, text, chunk=chunk).tolist() == whole, chunk
    assert len(pieces) > 100 and "".join(pieces[: len(pieces) // 4]) in text  # in pieces


def test_token_ids_are_cached_and_memory_mapped(
    shakespeare: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    tok = build_tokenizer("char", [shakespeare[:20_000]], tmp_path)
    first = cached_ids(tok, shakespeare[:5000], tmp_path)
    files = sorted((tmp_path / "tokens").iterdir())
    assert [f.suffix for f in files] == [".int64", ".sha256"]
    assert files[0].stat().st_size == 8 * 5000  # int64 ids, nothing else

    def no_encoding(text: str) -> list[int]:
        raise AssertionError("encoded again")

    monkeypatch.setattr(tok, "encode", no_encoding)
    again = cached_ids(tok, shakespeare[:5000], tmp_path)
    assert torch.equal(again, first) and again.dtype == torch.long
    again[0] = -1  # copy-on-write: the file keeps its ids
    assert cached_ids(tok, shakespeare[:5000], tmp_path)[0] == first[0]
    monkeypatch.undo()
    # another text, or the same text under another vocabulary: a file of its own
    cached_ids(tok, shakespeare[:4000], tmp_path)
    other = build_tokenizer("char", [shakespeare[:20_000] + "~"], tmp_path)
    assert cached_ids(other, shakespeare[:5000], tmp_path).tolist() == other.encode(
        shakespeare[:5000]
    )
    assert len(list((tmp_path / "tokens").glob("*.int64"))) == 3
    # a file changed since it was written is encoded again, with a warning, and rewritten
    with files[0].open("r+b") as f:
        f.write(b"\x01")
    with caplog.at_level(logging.WARNING, logger="posenc.data.lm"):
        repaired = cached_ids(tok, shakespeare[:5000], tmp_path)
    assert torch.equal(repaired, first) and "changed since posenc wrote it" in caplog.text
    assert torch.equal(cached_ids(tok, shakespeare[:5000], tmp_path), first)
    # a cache that cannot be written (a file where its folder goes): the ids all the same
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "tokens").write_text("not a folder")
    assert torch.equal(cached_ids(tok, shakespeare[:5000], blocked), first)


def test_a_data_module_reads_the_ids_an_earlier_run_cached(
    shakespeare: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _module(shakespeare, tmp_path)
    calls = []
    encode = CharTokenizer.encode
    monkeypatch.setattr(CharTokenizer, "encode", lambda self, t: calls.append(t) or encode(self, t))
    second = _module(shakespeare, tmp_path)
    assert calls == []  # every split from the cache
    for split in first.splits:
        assert torch.equal(second.lm_split_tokens(split), first.lm_split_tokens(split))


# -------------------------------------------------------------------------------- sources


def test_tinyshakespeare_splits(shakespeare: str) -> None:
    parts = tinyshakespeare()
    assert "".join(parts[s] for s in ("train", "val", "test")) == shakespeare
    n = len(shakespeare)
    assert len(parts["train"]) == int(n * 0.9) and len(parts["val"]) == int(n * 0.95) - int(n * 0.9)
    nano = tinyshakespeare(splits=(0.9, 0.1, 0.0))
    assert nano["train"] + nano["val"] == shakespeare and "test" not in nano
    with pytest.raises(ValueError, match=r"must sum to 1, got \(0.9, 0.2, 0.0\)"):
        tinyshakespeare(splits=(0.9, 0.2, 0.0))
    with pytest.raises(ValueError, match="3 non-negative fractions"):
        tinyshakespeare(splits=(0.9, 0.1))


def test_text_files_plain_and_gz(tmp_path: Path) -> None:
    (tmp_path / "train.txt").write_text("hello\nworld\n")
    (tmp_path / "val.txt.gz").write_bytes(gzip.compress("välid\n".encode()))
    out = text_files(tmp_path / "train.txt", tmp_path / "val.txt.gz")
    assert out == {"train": "hello\nworld\n", "val": "välid\n"}  # no test file, no test split
    with pytest.raises(FileNotFoundError, match=r"'test' file '.*nope\.txt' does not exist"):
        text_files(tmp_path / "train.txt", tmp_path / "val.txt.gz", str(tmp_path / "nope.txt"))


def test_wikitext103_joins_and_cleans_with_fake_loader(tmp_path: Path) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_load(name: str, config: str, cache_dir: str) -> dict[str, dict[str, list[str]]]:
        calls.append((name, config, cache_dir))
        rows = [
            "",
            " = Title = \n",
            "",
            " First line , with @-@ escape . \n",
            "",
            "",
            " Second paragraph . \n",
            "",
        ]
        return {
            "train": {"text": rows},
            "validation": {"text": ["", " = Val = \n", " v . \n"]},
            "test": {"text": [" t . \n"]},
        }

    out = wikitext103(root=tmp_path, loader=fake_load)
    assert out["train"] == "= Title =\n\nFirst line , with @-@ escape .\n\nSecond paragraph .\n"
    assert out["val"] == "= Val =\nv .\n" and out["test"] == "t .\n"
    assert calls[0][:2] == ("wikitext", "wikitext-103-raw-v1")

    with pytest.raises(ValueError, match="no 'validation' split"):
        wikitext103(root=tmp_path, loader=lambda *a, **k: {"train": {"text": ["x"]}})


def test_wikitext103_without_datasets_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user error (one line, no traceback from run.py) naming the package, the install
    command and the folder the data goes to."""
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError) as err:
        wikitext103(root=tmp_path)
    message = str(err.value)
    assert "\n" not in message
    assert "'datasets' package" in message and 'pip install "posenc[hf]"' in message
    assert str(tmp_path / "hf") in message and "data=text_files" in message


def test_wikitext103_offline_says_where_the_data_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POSENC_DATA_DIR", str(tmp_path))

    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'wikitext' on the Hub (offline)\nmore lines")

    with pytest.raises(DataError) as err:
        wikitext103(root=tmp_path, loader=offline)
    message = str(err.value)
    assert "\n" not in message
    assert "ConnectionError: Couldn't reach 'wikitext'" in message
    assert str(tmp_path / "hf") in message and "HF_DATASETS_OFFLINE=1" in message
