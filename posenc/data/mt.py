"""A LightningDataModule for machine translation: tokenized pairs, token-budget batches.

:class:`MTDataModule` takes a parallel source (:mod:`posenc.data.sources`), trains one
joint tokenizer on the training sources and targets, drops training pairs that are too
long (this is how "train short, test long" experiments are made), and batches by token
count with length bucketing via :class:`posenc.data.samplers.TokenBucketSampler`.
Evaluation batches are sorted by length but carry each example's original index so
outputs can be put back into file order with :func:`restore_order`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

from posenc.data.buckets import bucket_of, check_edges
from posenc.data.samplers import TokenBucketSampler, trainer_progress
from posenc.data.sources import SPLITS, ParallelCorpus
from posenc.data.tokenizers import Tokenizer, build_tokenizer, tokenizer_settings
from posenc.errors import DataError

__all__ = [
    "MTCollator",
    "MTDataModule",
    "encode_sentences",
    "restore_order",
]


class _PairDataset(Dataset):
    """Tokenized pairs; indexing with a list of positions returns a list of examples."""

    def __init__(self, src: list[list[int]], tgt: list[list[int]], index: list[int]) -> None:
        self.src, self.tgt, self.index = src, tgt, index

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, pos: int | list[int]) -> Any:
        if isinstance(pos, list):
            return [(self.src[p], self.tgt[p], self.index[p]) for p in pos]
        return self.src[pos], self.tgt[pos], self.index[pos]


class MTCollator:
    """Pads tokenized pairs into a batch dict (a class, not a closure, so workers can pickle it).

    Args:
        pad_id: Padding id.
        bos_id: Beginning-of-sentence id, prepended to the decoder input.
        eos_id: End-of-sentence id, appended to the decoder output.
    """

    def __init__(self, pad_id: int, bos_id: int, eos_id: int) -> None:
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def __call__(self, examples: Sequence[tuple[list[int], list[int], int]]) -> dict[str, Any]:
        """Collate ``(src_ids, tgt_ids, original_index)`` triples.

        Args:
            examples: B triples; ``src_ids`` and ``tgt_ids`` carry no BOS/EOS.

        Returns:
            Dict with ``src`` (B, S) long, ``src_mask`` (B, S) bool (True = real token),
            ``tgt_in`` (B, T) long = BOS + target, ``tgt_out`` (B, T) long = target + EOS,
            ``tgt_mask`` (B, T) bool, ``index`` (B,) long original example indices and
            ``src_len`` (B,) long source lengths; S = max source length (at least 1) and
            T = max target length + 1.
        """
        if len(examples) == 0:
            raise ValueError("cannot collate an empty batch.")
        b = len(examples)
        s = max(1, max(len(src) for src, _, _ in examples))
        t = max(len(tgt) for _, tgt, _ in examples) + 1
        src = torch.full((b, s), self.pad_id, dtype=torch.long)
        tgt_in = torch.full((b, t), self.pad_id, dtype=torch.long)
        tgt_out = torch.full((b, t), self.pad_id, dtype=torch.long)
        src_len = torch.empty(b, dtype=torch.long)
        tgt_len = torch.empty(b, dtype=torch.long)
        index = torch.empty(b, dtype=torch.long)
        for row, (src_ids, tgt_ids, idx) in enumerate(examples):
            n, m = len(src_ids), len(tgt_ids)
            src[row, :n] = torch.tensor(src_ids, dtype=torch.long)
            tgt_in[row, 0] = self.bos_id
            tgt_in[row, 1 : m + 1] = torch.tensor(tgt_ids, dtype=torch.long)
            tgt_out[row, :m] = torch.tensor(tgt_ids, dtype=torch.long)
            tgt_out[row, m] = self.eos_id
            src_len[row], tgt_len[row], index[row] = n, m + 1, idx
        positions_s = torch.arange(s)
        positions_t = torch.arange(t)
        return {
            "src": src,
            "src_mask": positions_s[None, :] < src_len[:, None],
            "tgt_in": tgt_in,
            "tgt_out": tgt_out,
            "tgt_mask": positions_t[None, :] < tgt_len[:, None],
            "index": index,
            "src_len": src_len,
        }


def restore_order(indices: Sequence[int] | torch.Tensor, items: Sequence[Any]) -> list[Any]:
    """Put per-example outputs of a length-sorted evaluation back into file order.

    Args:
        indices: Original indices of the outputs, e.g. the concatenated ``batch["index"]``
            tensors of an evaluation epoch; must be a permutation of ``0..N-1``.
        items: The N outputs (e.g. decoded hypotheses), aligned with ``indices``.

    Returns:
        ``out`` with ``out[indices[k]] = items[k]``.

    Raises:
        ValueError: Lengths differ, or ``indices`` is not a permutation of ``0..N-1``.
    """
    idx = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
    if len(idx) != len(items):
        raise ValueError(f"got {len(idx)} indices for {len(items)} items; pass one per item.")
    n = len(idx)
    if sorted(idx) != list(range(n)):
        dupes = sorted(i for i, c in Counter(idx).items() if c > 1)
        missing = sorted(set(range(n)) - set(idx))
        raise ValueError(
            f"indices are not a permutation of 0..{n - 1}: duplicated {dupes[:10]}, missing "
            f"{missing[:10]}. Collect the outputs of exactly one full pass over the loader."
        )
    out: list[Any] = [None] * n
    for k, i in enumerate(idx):
        out[i] = items[k]
    return out


# --------------------------------------------------------------------------------------------
# DataModule
# --------------------------------------------------------------------------------------------


def encode_sentences(tok: Tokenizer, sentences: Sequence[str]) -> list[list[int]]:
    """``[tok.encode(s) for s in sentences]``, but in one call where the tokenizer allows it.

    A SentencePiece call has a fixed cost (it starts worker threads) that dominates
    sentence-sized calls: one call per sentence made tokenizing Multi30k ~30x slower. A
    tokenizer with a ``newline_id`` encodes text line by line, so the sentences are joined by
    ``"\n"`` and the ids split at that id; the result is identical.
    """
    newline = getattr(tok, "newline_id", None)
    if newline is None or not sentences or any("\n" in s for s in sentences):
        return [tok.encode(s) for s in sentences]
    out: list[list[int]] = [[]]
    for i in tok.encode("\n".join(sentences)):
        if i == newline:
            out.append([])
        else:
            out[-1].append(i)
    return out


def _check_corpus(data: Any) -> ParallelCorpus:
    if not isinstance(data, Mapping):
        raise TypeError(
            f"the MT source returned a {type(data).__name__}; it must return a dict "
            "{split: (sources, targets)} with splits 'train', 'val' and optionally 'test'."
        )
    for split in ("train", "val"):
        if split not in data:
            raise ValueError(
                f"the MT source returned splits {sorted(data)} but no {split!r}; it must return "
                "'train' and 'val' (and optionally 'test'). Rename e.g. 'validation' to 'val'."
            )
    out: ParallelCorpus = {}
    for split in SPLITS:
        if split not in data:
            continue
        pair = data[split]
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ValueError(
                f"split {split!r} of the MT source must be a (sources, targets) pair of lists."
            )
        src, tgt = list(pair[0]), list(pair[1])
        if len(src) != len(tgt):
            raise DataError(
                f"split {split!r} has {len(src)} sources but {len(tgt)} targets; they must be "
                "aligned one to one."
            )
        if not src:
            raise DataError(f"split {split!r} of the MT source is empty; it needs sentences.")
        out[split] = (src, tgt)
    return out


class MTDataModule(pl.LightningDataModule):
    """Tokenized, length-filtered, token-budget-batched translation data.

    Batches are dicts produced by :class:`MTCollator`. Training pairs are dropped (and counted
    in :attr:`stats`) when either side tokenizes to nothing, when the source exceeds
    ``max_len`` tokens or the decoder sequence (target + 1) does, or when the source exceeds
    ``max_train_src_len``. Validation and test pairs are never dropped: long ones are exactly
    what length-extrapolation experiments measure.

    Args:
        source: Callable returning ``{split: (sources, targets)}``, e.g.
            ``functools.partial(multi30k, direction="de-en")``.
        tokenizer: ``{"kind": "char" | "bpe" | "unigram", **settings}`` (e.g. ``vocab_size``)
            for :func:`posenc.data.tokenizers.build_tokenizer`; one joint tokenizer is trained
            on the training sources and targets only.
        cache_dir: Folder for cached tokenizers (created if missing).
        max_tokens: Token budget per batch (batch size x longest sequence in the batch).
        max_train_src_len: Drop training pairs whose tokenized source is longer; ``None`` keeps
            them. Used to train on short sentences and test on long ones.
        max_len: Hard cap on source length and on target length + 1 for training pairs.
        length_buckets: Source-length bucket edges in tokens, see :func:`bucket_of`.
        num_workers: DataLoader worker processes.
        seed: Seed of the per-epoch batch shuffling.
        shuffle_chunk: Chunk size of :class:`TokenBucketSampler`; ``None`` keeps the number of
            batches identical across epochs.
    """

    def __init__(
        self,
        *,
        source: Callable[[], Mapping[str, tuple[Sequence[str], Sequence[str]]]],
        tokenizer: Mapping[str, Any],
        cache_dir: str | os.PathLike[str],
        max_tokens: int = 4096,
        max_train_src_len: int | None = None,
        max_len: int = 256,
        length_buckets: Sequence[int] = (0, 10, 20, 30, 40, 1000),
        num_workers: int = 0,
        seed: int = 0,
        shuffle_chunk: int | None = None,
    ) -> None:
        super().__init__()
        if not callable(source):
            raise TypeError(
                f"source must be a callable returning {{split: (sources, targets)}}, got "
                f"{type(source).__name__}; e.g. functools.partial(multi30k, direction='en-de')."
            )
        tok_cfg = dict(tokenizer)
        if "kind" not in tok_cfg:
            raise ValueError(
                f"tokenizer settings {tok_cfg} lack 'kind'; add kind='char', 'bpe' or 'unigram'."
            )
        if max_len < 2:
            raise ValueError(f"max_len must be at least 2 (one token plus EOS), got {max_len}.")
        if max_tokens < max_len:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than max_len={max_len}, so the longest "
                "allowed training pair would not fit in a batch; raise max_tokens or lower max_len."
            )
        if max_train_src_len is not None and max_train_src_len < 1:
            raise ValueError(
                f"max_train_src_len must be a positive int or None, got {max_train_src_len}."
            )
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}.")
        edges = [int(e) for e in length_buckets]
        check_edges(edges)
        self.source = source
        self.tokenizer_cfg = tok_cfg
        self.cache_dir = Path(cache_dir).expanduser()
        self.max_tokens = int(max_tokens)
        self.max_train_src_len = max_train_src_len
        self.max_len = int(max_len)
        self.length_buckets = edges
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.shuffle_chunk = shuffle_chunk
        #: Counts of loaded, dropped and kept pairs, filled by :meth:`setup`.
        self.stats: dict[str, int] = {}
        self._tokenizer: Tokenizer | None = None
        self._raw: ParallelCorpus = {}
        self._datasets: dict[str, _PairDataset] = {}
        self._lengths: dict[str, list[int]] = {}

    # ---- Lightning hooks ---------------------------------------------------------------

    def prepare_data(self) -> None:
        """Download the corpus if needed (Lightning runs this on one process only)."""
        self.source()

    def setup(self, stage: str | None = None) -> None:
        """Load, tokenize and filter all splits once; later calls do nothing."""
        if self._tokenizer is not None:
            return
        raw = _check_corpus(self.source())
        train_src, train_tgt = raw["train"]
        settings = tokenizer_settings(
            self.tokenizer_cfg["kind"],
            {k: v for k, v in self.tokenizer_cfg.items() if k != "kind"},
        )
        tok = build_tokenizer(
            self.tokenizer_cfg["kind"], [*train_src, *train_tgt], self.cache_dir, **settings
        )
        stats: dict[str, int] = {}
        for split, (src_text, tgt_text) in raw.items():
            src_ids = encode_sentences(tok, src_text)
            tgt_ids = encode_sentences(tok, tgt_text)
            keep = list(range(len(src_ids)))
            if split == "train":
                keep = self._filter_train(src_ids, tgt_ids, stats)
            else:
                stats[f"{split}_pairs"] = len(src_ids)
                stats[f"{split}_over_max_len"] = sum(
                    len(s) > self.max_len or len(t) + 1 > self.max_len
                    for s, t in zip(src_ids, tgt_ids, strict=True)
                )
            self._datasets[split] = _PairDataset(
                [src_ids[i] for i in keep], [tgt_ids[i] for i in keep], keep
            )
            self._lengths[split] = [len(s) for s in src_ids]
        self._raw = raw
        self.stats = stats
        self._tokenizer = tok
        rank_zero_info(
            f"MT data: {stats['train_pairs']} training pairs, kept {stats['train_kept']}; "
            f"dropped {stats['dropped_empty']} with an empty side, "
            f"{stats['dropped_max_len']} longer than max_len={self.max_len}, "
            f"{stats['dropped_max_train_src_len']} with source longer than "
            f"max_train_src_len={self.max_train_src_len}. Vocabulary: {tok.vocab_size}."
        )

    def _filter_train(
        self, src_ids: list[list[int]], tgt_ids: list[list[int]], stats: dict[str, int]
    ) -> list[int]:
        # Each dropped pair is counted under the first reason that applies, so counts add up.
        keep: list[int] = []
        empty = too_long = too_long_src = 0
        for i, (s, t) in enumerate(zip(src_ids, tgt_ids, strict=True)):
            if not s or not t:
                empty += 1
            elif len(s) > self.max_len or len(t) + 1 > self.max_len:
                too_long += 1
            elif self.max_train_src_len is not None and len(s) > self.max_train_src_len:
                too_long_src += 1
            else:
                keep.append(i)
        if not keep:
            raise DataError(
                f"all {len(src_ids)} training pairs were dropped (max_len={self.max_len}, "
                f"max_train_src_len={self.max_train_src_len}); raise these limits."
            )
        stats.update(
            train_pairs=len(src_ids),
            train_kept=len(keep),
            dropped_empty=empty,
            dropped_max_len=too_long,
            dropped_max_train_src_len=too_long_src,
        )
        return keep

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        ds = self._dataset(split)
        costs = [max(len(s), len(t) + 1) for s, t in zip(ds.src, ds.tgt, strict=True)]
        sampler = TokenBucketSampler(
            costs,
            self.max_tokens,
            shuffle=shuffle,
            seed=self.seed,
            chunk_size=self.shuffle_chunk,
            progress=trainer_progress(self) if shuffle else None,
        )
        tok = self.tokenizer
        return DataLoader(
            ds,
            sampler=sampler,
            batch_size=None,
            collate_fn=MTCollator(tok.pad_id, tok.bos_id, tok.eos_id),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled token-budget batches of the kept training pairs."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """All validation pairs, sorted by length, each batch carrying original indices."""
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """All test pairs, sorted by length, each batch carrying original indices."""
        return self._loader("test", shuffle=False)

    # ---- accessors ---------------------------------------------------------------------

    def _dataset(self, split: str) -> _PairDataset:
        if self._tokenizer is None:
            raise RuntimeError("MTDataModule is not set up yet; call dm.setup() first.")
        if split not in self._datasets:
            raise ValueError(
                f"split {split!r} is not available; this corpus has {sorted(self._datasets)}."
            )
        return self._datasets[split]

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits the corpus has (after :meth:`setup`): train, val, and test if given."""
        if self._tokenizer is None:
            raise RuntimeError("MTDataModule is not set up yet; call dm.setup() first.")
        return tuple(s for s in SPLITS if s in self._datasets)

    @property
    def tokenizer(self) -> Tokenizer:
        """The joint source/target tokenizer (available after :meth:`setup`)."""
        if self._tokenizer is None:
            raise RuntimeError("MTDataModule is not set up yet; call dm.setup() first.")
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Size of the joint vocabulary."""
        return int(self.tokenizer.vocab_size)

    @property
    def pad_id(self) -> int:
        """Padding id."""
        return int(self.tokenizer.pad_id)

    @property
    def bos_id(self) -> int:
        """Beginning-of-sentence id."""
        return int(self.tokenizer.bos_id)

    @property
    def eos_id(self) -> int:
        """End-of-sentence id."""
        return int(self.tokenizer.eos_id)

    def sources(self, split: str) -> list[str]:
        """Raw source sentences of a split in file order (all of them, even for train)."""
        self._dataset(split)
        return list(self._raw[split][0])

    def references(self, split: str) -> list[str]:
        """Raw (detokenized) target sentences of a split in file order, for BLEU/chrF."""
        self._dataset(split)
        return list(self._raw[split][1])

    def source_lengths(self, split: str) -> list[int]:
        """Tokenized source length of every example of a split, in file order."""
        self._dataset(split)
        return list(self._lengths[split])

    def buckets(self, split: str) -> list[str]:
        """Length-bucket name of every example of a split, in file order."""
        return [bucket_of(n, self.length_buckets) for n in self.source_lengths(split)]
