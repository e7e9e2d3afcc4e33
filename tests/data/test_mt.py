"""Translation data: sources, token-budget batching, filtering, collation and order restoring."""

from __future__ import annotations

import gzip
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning_fabric.utilities.data import _set_sampler_epoch

from posenc.data.buckets import bucket_names, bucket_of
from posenc.data.download import data_dir
from posenc.data.mt import MTCollator, MTDataModule, restore_order
from posenc.data.samplers import TokenBucketSampler
from posenc.data.sources import hf_translation, multi30k, parallel_files


def _gz_lines(name: str) -> list[str]:
    with gzip.open(Path(data_dir()) / "multi30k" / name, "rt", encoding="utf-8") as f:
        return f.read().split("\n")[:-1]


@pytest.fixture(scope="module")
def m30k() -> dict[str, tuple[list[str], list[str]]]:
    return multi30k()


# ---- sources --------------------------------------------------------------------------------


def test_multi30k_sizes_and_alignment(m30k: dict[str, tuple[list[str], list[str]]]) -> None:
    assert {k: (len(s), len(t)) for k, (s, t) in m30k.items()} == {
        "train": (29000, 29000),
        "val": (1014, 1014),
        "test": (1000, 1000),
    }
    for split, stem in (("train", "train"), ("val", "val"), ("test", "test_2016_flickr")):
        en, de = _gz_lines(f"{stem}.en.gz"), _gz_lines(f"{stem}.de.gz")
        src, tgt = m30k[split]
        assert (src[0], tgt[0]) == (en[0], de[0])
        assert (src[-1], tgt[-1]) == (en[-1], de[-1])
    assert m30k["train"][0][0] == "Two young, White males are outside near many bushes."


def test_multi30k_de_en_swaps_sides(m30k: dict[str, tuple[list[str], list[str]]]) -> None:
    swapped = multi30k(direction="de-en")
    for split, (src, tgt) in m30k.items():
        assert swapped[split] == (tgt, src)
    with pytest.raises(ValueError, match="'en-fr'.*allowed: en-de, de-en"):
        multi30k(direction="en-fr")


def test_parallel_files_reads_plain_and_gz(tmp_path: Path) -> None:
    files = {
        # \r\n line ends are stripped; U+2028 inside a sentence must not split it.
        "tr.src": "eins\r\nzwei\u2028drei\r\n",
        "tr.tgt": "one\ntwo three\n",
        "va.src": "vier",
        "va.tgt": "four",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8", newline="")
    with gzip.open(tmp_path / "te.src.gz", "wt", encoding="utf-8") as f:
        f.write("fünf\nsechs\n")
    with gzip.open(tmp_path / "te.tgt.gz", "wt", encoding="utf-8") as f:
        f.write("five\nsix\n")
    p = {k: tmp_path / k for k in files}
    data = parallel_files(
        p["tr.src"],
        p["tr.tgt"],
        p["va.src"],
        p["va.tgt"],
        tmp_path / "te.src.gz",
        tmp_path / "te.tgt.gz",
    )
    assert data == {
        "train": (["eins", "zwei\u2028drei"], ["one", "two three"]),
        "val": (["vier"], ["four"]),
        "test": (["fünf", "sechs"], ["five", "six"]),
    }
    assert set(parallel_files(p["tr.src"], p["tr.tgt"], p["va.src"], p["va.tgt"])) == {
        "train",
        "val",
    }
    with pytest.raises(ValueError, match="test_src was given but test_tgt was not"):
        parallel_files(p["tr.src"], p["tr.tgt"], p["va.src"], p["va.tgt"], test_src=p["va.src"])


def test_parallel_files_line_count_mismatch(tmp_path: Path) -> None:
    (tmp_path / "a.de").write_text("x\ny\nz\n")
    (tmp_path / "a.en").write_text("x\ny\n")
    with pytest.raises(ValueError) as err:
        parallel_files(tmp_path / "a.de", tmp_path / "a.en", tmp_path / "a.de", tmp_path / "a.de")
    msg = str(err.value)
    assert "a.de has 3 lines" in msg and "a.en has 2" in msg


class _FakeColumnDataset:
    """Mimics the parts of a Hugging Face ``Dataset`` that hf_translation uses."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.column_names = list(rows[0])

    def __getitem__(self, column: str) -> list[Any]:
        return [row[column] for row in self.rows]


def test_hf_translation_with_fake_loader() -> None:
    def row(en: str, de: str) -> dict[str, Any]:
        return {"translation": {"de": de, "en": en}}

    calls: list[tuple[str, str]] = []

    def loader(name: str, config: str) -> dict[str, Any]:
        calls.append((name, config))
        return {
            "train": _FakeColumnDataset([row("a cat", "eine Katze"), row("a dog", "ein Hund")]),
            "validation": [row("red", "rot")],  # plain rows take the generic path
            "test": _FakeColumnDataset([row("blue", "blau")]),
            "extra": [row("x", "y")],
        }

    data = hf_translation("wmt14", "de-en", "en", "de", loader=loader)
    assert calls == [("wmt14", "de-en")]
    assert data == {
        "train": (["a cat", "a dog"], ["eine Katze", "ein Hund"]),
        "val": (["red"], ["rot"]),
        "test": (["blue"], ["blau"]),
    }
    assert hf_translation("wmt14", "de-en", "de", "en", loader=loader)["val"] == (["rot"], ["red"])
    with pytest.raises(ValueError, match=r"languages \['de', 'en'\].*src_lang='fr'"):
        hf_translation("wmt14", "de-en", "fr", "en", loader=loader)
    with pytest.raises(ValueError, match="no 'train'"):
        hf_translation("x", "y", "en", "de", loader=lambda n, c: {"test": [row("a", "b")]})


def test_hf_translation_without_datasets_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install posenc\[hf\]"):
        hf_translation("wmt14", "de-en", "en", "de")


# ---- buckets --------------------------------------------------------------------------------


def test_every_length_falls_in_exactly_one_bucket() -> None:
    edges = [0, 10, 20, 30, 40, 1000]
    names = bucket_names(edges)
    assert names == ["len0-10", "len10-20", "len20-30", "len30-40", "len40+"]
    counts = Counter(bucket_of(n, edges) for n in range(5000))
    assert set(counts) == set(names) and sum(counts.values()) == 5000
    assert [bucket_of(n, edges) for n in (0, 9, 10, 39, 40, 999, 1000, 10**6)] == [
        "len0-10",
        "len0-10",
        "len10-20",
        "len30-40",
        "len40+",
        "len40+",
        "len40+",
        "len40+",
    ]
    for bad in ([0], [1, 5], [0, 5, 5], [0, 2.5]):
        with pytest.raises(ValueError, match="length bucket edges"):
            bucket_of(3, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        bucket_of(-1, edges)


# ---- sampler --------------------------------------------------------------------------------


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


@pytest.mark.parametrize("chunk_size", [None, 64])
def test_token_bucket_sampler_covers_each_index_once_within_budget(chunk_size: int | None) -> None:
    rng = random.Random(1)
    lengths = [rng.randint(1, 60) for _ in range(1000)]
    sampler = TokenBucketSampler(lengths, 240, shuffle=True, seed=7, chunk_size=chunk_size)
    orders = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = sampler.batches(epoch)
        assert sorted(_flat(batches)) == list(range(1000))
        # Every epoch has epoch 0's count, which Lightning reads once: a longer one stops
        # there, a shorter one repeats its first batches.
        assert len(sampler) == len(sampler.batches(0))
        assert list(sampler) == [batches[i % len(batches)] for i in range(len(sampler))]
        assert all(len(b) * max(lengths[i] for i in b) <= 240 for b in batches)
        orders.append(_flat(batches))
    assert orders[0] != orders[1]
    assert chunk_size is None or len(sampler.batches(0)) != len(sampler.batches(1))  # capped
    sampler.set_epoch(0)
    assert _flat(list(sampler)) == orders[0]  # deterministic from seed + epoch
    again = TokenBucketSampler(lengths, 240, shuffle=True, seed=7, chunk_size=chunk_size)
    assert _flat(list(again)) == orders[0]


def test_token_bucket_sampler_groups_similar_lengths() -> None:
    rng = random.Random(2)
    lengths = [rng.randint(1, 100) for _ in range(3000)]
    batches = list(TokenBucketSampler(lengths, 1000, shuffle=True, seed=0))
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded / sum(lengths) < 1.05  # length bucketing keeps padding small
    # Without chunks the batch count depends only on the lengths, so it is the same every
    # epoch (Lightning reads len(dataloader) once).
    sampler = TokenBucketSampler(lengths, 1000, shuffle=True, seed=0)
    counts = set()
    for epoch in range(4):
        sampler.set_epoch(epoch)
        counts.add(len(list(sampler)))
    assert counts == {len(batches)}


def test_eval_sampler_is_sorted_and_keeps_oversized_examples() -> None:
    lengths = [5, 3, 50, 3, 8, 1, 0]
    sampler = TokenBucketSampler(lengths, 10, shuffle=False)
    batches = list(sampler)
    flat = _flat(batches)
    assert sorted(flat) == list(range(7))
    assert [lengths[i] for i in flat] == sorted(lengths)
    assert [2] in batches  # longer than the budget: alone, not lost
    sampler.set_epoch(5)
    assert list(sampler) == batches  # no shuffling in evaluation


# ---- data module ----------------------------------------------------------------------------


def _toy_source() -> dict[str, tuple[list[str], list[str]]]:
    rng = random.Random(3)
    words = ["ab", "cd", "efg", "h", "ij", "klm"]

    def sent(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    def pairs(k: int, lo: int, hi: int) -> tuple[list[str], list[str]]:
        src = [sent(rng.randint(lo, hi)) for _ in range(k)]
        return src, [s.upper()[::-1] + " ." for s in src]

    train = pairs(300, 1, 12)
    train[0][5] = ""  # an empty source is dropped and counted
    return {"train": train, "val": pairs(40, 1, 20), "test": pairs(30, 1, 20)}


def _toy_module(tmp_path: Path, **kw: Any) -> MTDataModule:
    args: dict[str, Any] = {
        "source": _toy_source,
        "tokenizer": {"kind": "char"},
        "cache_dir": tmp_path,
        "max_tokens": 400,
        "max_len": 80,
        "length_buckets": [0, 10, 20, 1000],
        "seed": 1,
    }
    args.update(kw)
    dm = MTDataModule(**args)
    dm.setup("fit")
    return dm


def test_max_train_src_len_drops_exactly_the_long_pairs(tmp_path: Path) -> None:
    dm = _toy_module(tmp_path, max_train_src_len=20, max_len=40)
    src, tgt = _toy_source()["train"]
    src_len = [len(dm.tokenizer.encode(s)) for s in src]
    tgt_len = [len(dm.tokenizer.encode(t)) for t in tgt]
    over_cap = {i for i in range(300) if src_len[i] > 40 or tgt_len[i] + 1 > 40} - {5}
    too_long = {i for i in range(300) if src_len[i] > 20} - over_cap - {5}
    assert over_cap and too_long  # the toy data exercises both limits
    kept = {int(i) for b in dm.train_dataloader() for i in b["index"]}
    assert kept == set(range(300)) - over_cap - too_long - {5}
    assert all(src_len[i] <= 20 for i in kept)
    assert dm.stats["dropped_empty"] == 1
    assert dm.stats["dropped_max_len"] == len(over_cap)
    assert dm.stats["dropped_max_train_src_len"] == len(too_long)
    assert dm.stats["train_kept"] == len(kept)
    # Evaluation sets keep their long sentences.
    assert len({int(i) for b in dm.val_dataloader() for i in b["index"]}) == 40
    assert max(dm.source_lengths("val")) > 20


def test_collated_batches_are_shifted_padded_and_masked(tmp_path: Path) -> None:
    dm = _toy_module(tmp_path)
    tok = dm.tokenizer
    src_text, tgt_text = _toy_source()["train"]
    loader = dm.train_dataloader()
    seen = []
    for batch in loader:
        b, s = batch["src"].shape
        t = batch["tgt_in"].shape[1]
        assert batch["src_mask"].shape == (b, s) and batch["src_mask"].dtype == torch.bool
        assert batch["tgt_out"].shape == batch["tgt_mask"].shape == (b, t)
        assert batch["index"].shape == batch["src_len"].shape == (b,)
        assert b * max(s, t) <= 400
        assert torch.equal(batch["src_mask"].sum(1), batch["src_len"])
        assert torch.all(batch["src"][~batch["src_mask"]] == tok.pad_id)
        assert torch.all(batch["tgt_in"][:, 0] == tok.bos_id)
        m = batch["tgt_mask"]
        # Teacher forcing: the decoder output is its input shifted left by one.
        assert torch.equal(batch["tgt_in"][:, 1:][m[:, 1:]], batch["tgt_out"][:, :-1][m[:, 1:]])
        last = m.sum(1) - 1
        assert torch.all(batch["tgt_out"][torch.arange(b), last] == tok.eos_id)
        assert torch.all(batch["tgt_out"][~m] == tok.pad_id)
        for row, idx in enumerate(batch["index"].tolist()):
            n = int(batch["src_len"][row])
            assert tok.decode(batch["src"][row, :n].tolist()) == src_text[idx]
            k = int(m[row].sum()) - 1
            assert tok.decode(batch["tgt_out"][row, :k].tolist()) == tgt_text[idx]
        seen.extend(batch["index"].tolist())
    assert sorted(seen) == sorted(set(seen)) and len(seen) == dm.stats["train_kept"]


def test_collator_exact_tensors() -> None:
    batch = MTCollator(pad_id=0, bos_id=1, eos_id=2)([([5, 6, 7], [8], 4), ([9], [10, 11], 0)])
    assert batch["src"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["src_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["tgt_in"].tolist() == [[1, 8, 0], [1, 10, 11]]
    assert batch["tgt_out"].tolist() == [[8, 2, 0], [10, 11, 2]]
    assert batch["tgt_mask"].tolist() == [[True, True, False], [True, True, True]]
    assert batch["index"].tolist() == [4, 0] and batch["src_len"].tolist() == [3, 1]


def test_eval_loader_is_length_sorted_and_restorable(tmp_path: Path) -> None:
    dm = _toy_module(tmp_path)
    tok = dm.tokenizer
    indices, decoded, lengths = [], [], []
    for batch in dm.test_dataloader():
        for row in range(batch["src"].shape[0]):
            n = int(batch["src_len"][row])
            decoded.append(tok.decode(batch["src"][row, :n].tolist()))
            lengths.append(n)
        indices.append(batch["index"])
    assert lengths == sorted(lengths)
    assert restore_order(torch.cat(indices), decoded) == dm.sources("test")
    assert dm.source_lengths("test") == [len(tok.encode(s)) for s in dm.sources("test")]
    assert dm.references("test") == _toy_source()["test"][1]
    assert Counter(dm.buckets("test")) == Counter(
        bucket_of(n, [0, 10, 20, 1000]) for n in dm.source_lengths("test")
    )
    with pytest.raises(ValueError, match=r"duplicated \[0\], missing \[1\]"):
        restore_order([0, 0], ["a", "b"])


def test_the_train_loader_follows_the_trainers_step(tmp_path: Path) -> None:
    loader = _toy_module(tmp_path).train_dataloader()

    def epoch(steps: int, accumulate: int = 1) -> list[list[int]]:
        loader.sampler.progress = lambda: (steps, accumulate)  # what the trainer reports
        return [b["index"].tolist() for b in loader]

    first = epoch(0)
    n = len(first)
    assert n == len(loader) > 2
    second = epoch(n)  # one epoch done: the next one, shuffled anew
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    assert epoch(n + 2) == second[2:]  # resumed two steps into the second epoch
    assert epoch(1) == first[1:]
    # Two batches a step: an epoch of whole steps (its first batch again if n is odd).
    whole = -(-n // 2) * 2
    assert epoch(whole // 2, accumulate=2) == (second + second)[:whole]
    assert epoch(1, accumulate=2) == (first + first)[2:whole]
    _set_sampler_epoch(loader, 5)  # Lightning's call at each epoch start changes nothing
    assert epoch(0) == first


def test_multi30k_module_with_train_short_test_long(tmp_path: Path) -> None:
    dm = MTDataModule(
        source=multi30k,
        tokenizer={"kind": "char"},
        cache_dir=tmp_path,
        max_tokens=6000,
        max_train_src_len=60,
        max_len=300,
        length_buckets=[0, 40, 60, 80, 1000],
    )
    dm.setup()
    src_train = multi30k()["train"][0]
    expected_drop = sum(len(dm.tokenizer.encode(s)) > 60 for s in src_train)
    assert dm.stats["train_pairs"] == 29000
    assert dm.stats["dropped_max_train_src_len"] + dm.stats["dropped_max_len"] == expected_drop
    assert dm.stats["train_kept"] == 29000 - expected_drop - dm.stats["dropped_empty"]
    assert dm.vocab_size == len(set("".join(src_train + multi30k()["train"][1]))) + 4
    counts = Counter(dm.buckets("test"))
    assert sum(counts.values()) == 1000 and counts["len60-80"] > 0 and counts["len80+"] > 0
    assert len(dm.references("val")) == 1014


def test_bad_settings_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens=100 is smaller than max_len=256"):
        MTDataModule(
            source=_toy_source, tokenizer={"kind": "char"}, cache_dir=tmp_path, max_tokens=100
        )
    with pytest.raises(ValueError, match="lack 'kind'"):
        MTDataModule(source=_toy_source, tokenizer={"vocab_size": 10}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="length bucket edges"):
        MTDataModule(
            source=_toy_source,
            tokenizer={"kind": "char"},
            cache_dir=tmp_path,
            length_buckets=[0, 10, 5],
        )

    def no_val() -> dict[str, Any]:
        return {"train": (["a"], ["b"]), "validation": (["a"], ["b"])}

    dm = MTDataModule(source=no_val, tokenizer={"kind": "char"}, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no 'val'.*Rename e.g. 'validation'"):
        dm.setup()
    with pytest.raises(RuntimeError, match="call dm.setup"):
        _ = dm.vocab_size
