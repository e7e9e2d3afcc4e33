"""Parallel corpora, token-budget batching and a LightningDataModule for machine translation.

A *source* is any callable returning ``{split: (sources, targets)}`` with splits ``"train"``,
``"val"`` and optionally ``"test"``; :func:`multi30k`, :func:`parallel_files` and
:func:`hf_translation` are the built-in ones. :class:`MTDataModule` trains one joint tokenizer
on the training sources and targets, drops training pairs that are too long (this is how
"train short, test long" experiments are made), and batches by token count with length
bucketing via :class:`TokenBucketSampler`. Evaluation batches are sorted by length but carry
each example's original index so outputs can be put back into file order with
:func:`restore_order`.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset, Sampler

from posenc.data.download import fetch, read_text
from posenc.data.tokenizers import Tokenizer, build_tokenizer
from posenc.errors import DataError

__all__ = [
    "MTCollator",
    "MTDataModule",
    "ParallelCorpus",
    "TokenBucketSampler",
    "bucket_names",
    "bucket_of",
    "check_edges",
    "encode_sentences",
    "hf_translation",
    "multi30k",
    "parallel_files",
    "restore_order",
]

#: split name -> (source sentences, target sentences), aligned line by line.
ParallelCorpus = dict[str, tuple[list[str], list[str]]]

SPLITS = ("train", "val", "test")
MULTI30K_DIRECTIONS = ("en-de", "de-en")
# Multi30k task 1 file stems per split; the 2016 Flickr test set is the standard test split.
_MULTI30K_STEMS = {"train": "train", "val": "val", "test": "test_2016_flickr"}
# Hugging Face split names -> posenc split names.
_HF_SPLITS = {"train": "train", "validation": "val", "test": "test"}


# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------


def _lines(text: str) -> list[str]:
    """Split file text into lines on ``\\n`` only.

    ``str.splitlines`` also breaks on characters such as U+2028 or U+0085 that can occur inside
    a sentence, which would silently misalign a parallel corpus, so it is not used.
    """
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _read_pair(
    src_path: str | os.PathLike[str], tgt_path: str | os.PathLike[str]
) -> tuple[list[str], list[str]]:
    src, tgt = _lines(read_text(src_path)), _lines(read_text(tgt_path))
    if len(src) != len(tgt):
        raise DataError(
            f"parallel files differ in line count: {src_path} has {len(src)} lines but "
            f"{tgt_path} has {len(tgt)}; line i of one must translate line i of the other. "
            "Check that the two files belong together and that neither is truncated."
        )
    return src, tgt


def multi30k(
    root: str | os.PathLike[str] | None = None, direction: str = "en-de"
) -> ParallelCorpus:
    """Multi30k task 1 (Elliott et al., 2016): 29,000 / 1,014 / 1,000 raw cased pairs.

    Files are fetched (downloaded and sha256-verified if missing) with
    :func:`posenc.data.download.fetch`; the test split is the 2016 Flickr test set.

    Args:
        root: Data folder; ``None`` means :func:`posenc.data.download.data_dir`.
        direction: ``"en-de"`` (English source) or ``"de-en"`` (German source).

    Returns:
        ``{"train": (src, tgt), "val": (src, tgt), "test": (src, tgt)}`` in file order.

    Raises:
        ValueError: Unknown direction, or a file pair differs in line count.
    """
    if direction not in MULTI30K_DIRECTIONS:
        raise ValueError(
            f"unknown Multi30k direction {direction!r}; allowed: {', '.join(MULTI30K_DIRECTIONS)}"
            " (source-target language codes)."
        )
    src_lang, tgt_lang = direction.split("-")
    out: ParallelCorpus = {}
    for split, stem in _MULTI30K_STEMS.items():
        src_path = fetch(f"multi30k/{stem}.{src_lang}.gz", root=root)
        tgt_path = fetch(f"multi30k/{stem}.{tgt_lang}.gz", root=root)
        out[split] = _read_pair(src_path, tgt_path)
    return out


def parallel_files(
    train_src: str | os.PathLike[str],
    train_tgt: str | os.PathLike[str],
    val_src: str | os.PathLike[str],
    val_tgt: str | os.PathLike[str],
    test_src: str | os.PathLike[str] | None = None,
    test_tgt: str | os.PathLike[str] | None = None,
) -> ParallelCorpus:
    """Read a parallel corpus from local text files, one sentence per line (plain or ``.gz``).

    Args:
        train_src: Training source sentences.
        train_tgt: Training target sentences, line-aligned with ``train_src``.
        val_src: Validation source sentences.
        val_tgt: Validation target sentences.
        test_src: Optional test source sentences; give both test files or neither.
        test_tgt: Optional test target sentences.

    Returns:
        ``{"train": ..., "val": ..., "test": ...}`` (``"test"`` only if test files are given).

    Raises:
        ValueError: A source/target pair differs in line count, or only one test file is given.
    """
    if (test_src is None) != (test_tgt is None):
        given, missing = ("test_src", "test_tgt") if test_tgt is None else ("test_tgt", "test_src")
        raise DataError(
            f"{given} was given but {missing} was not; pass both test files or neither."
        )
    out: ParallelCorpus = {
        "train": _read_pair(train_src, train_tgt),
        "val": _read_pair(val_src, val_tgt),
    }
    if test_src is not None and test_tgt is not None:
        out["test"] = _read_pair(test_src, test_tgt)
    return out


def _translation_column(split_data: Any) -> Sequence[Mapping[str, str]]:
    # A Hugging Face Dataset returns a whole column at once (fast, Arrow-backed); anything else
    # is treated as an iterable of rows.
    if hasattr(split_data, "column_names"):
        if "translation" not in split_data.column_names:
            raise ValueError(
                f"dataset split has columns {list(split_data.column_names)} but no 'translation' "
                "column; hf_translation expects the WMT/IWSLT layout "
                "{'translation': {lang: sentence}}."
            )
        return split_data["translation"]
    return [row["translation"] for row in split_data]


def hf_translation(
    name: str,
    config: str,
    src_lang: str,
    tgt_lang: str,
    loader: Callable[..., Mapping[str, Any]] | None = None,
) -> ParallelCorpus:
    """A translation corpus from the Hugging Face hub (e.g. WMT14, IWSLT2017).

    Rows must have the WMT/IWSLT layout ``{"translation": {src_lang: ..., tgt_lang: ...}}``.
    Hugging Face splits ``train``/``validation``/``test`` become ``train``/``val``/``test``;
    other splits are ignored.

    Args:
        name: Dataset name, e.g. ``"wmt14"`` or ``"iwslt2017"``.
        config: Dataset configuration, e.g. ``"de-en"`` or ``"iwslt2017-en-de"``.
        src_lang: Language code of the source side, e.g. ``"en"``.
        tgt_lang: Language code of the target side, e.g. ``"de"``.
        loader: Called as ``loader(name, config)`` and must return a mapping of split name to
            rows; ``None`` means ``datasets.load_dataset``. Pass e.g.
            ``functools.partial(datasets.load_dataset, trust_remote_code=True)`` for datasets
            that need it, or a stand-in for tests.

    Returns:
        ``{"train": (src, tgt), "val": ..., "test": ...}`` for the splits present.

    Raises:
        ImportError: ``loader`` is None and ``datasets`` is not installed.
        ValueError: Same language on both sides, no train split, or a language missing from
            the rows.
    """
    if src_lang == tgt_lang:
        raise ValueError(
            f"src_lang and tgt_lang are both {src_lang!r}; give two different language codes."
        )
    if loader is None:
        try:
            from datasets import load_dataset
        except ImportError as err:
            raise ImportError(
                "hf_translation needs the Hugging Face 'datasets' package, which is not "
                "installed; install it with `pip install posenc[hf]` (or `pip install datasets`)."
            ) from err
        loader = load_dataset
    data = loader(name, config)
    if "train" not in data:
        raise ValueError(
            f"dataset {name!r} (config {config!r}) has splits {sorted(data)} but no 'train'; "
            "hf_translation needs a train split to build the tokenizer."
        )
    out: ParallelCorpus = {}
    for hf_split, split in _HF_SPLITS.items():
        if hf_split not in data:
            continue
        column = _translation_column(data[hf_split])
        src: list[str] = []
        tgt: list[str] = []
        for i, pair in enumerate(column):
            if src_lang not in pair or tgt_lang not in pair:
                raise DataError(
                    f"row {i} of split {hf_split!r} of {name!r} ({config!r}) has languages "
                    f"{sorted(pair)} but src_lang={src_lang!r}, tgt_lang={tgt_lang!r} were "
                    "asked for; pick codes from those languages or another config."
                )
            src.append(pair[src_lang])
            tgt.append(pair[tgt_lang])
        out[split] = (src, tgt)
    return out


# --------------------------------------------------------------------------------------------
# Length buckets
# --------------------------------------------------------------------------------------------


def check_edges(edges: Sequence[int]) -> None:
    """Validate length-bucket edges.

    Args:
        edges: At least two strictly increasing ints, the first one 0.

    Raises:
        ValueError: The edges do not satisfy the above.
    """
    edges = list(edges)
    example = "e.g. [0, 10, 20, 30, 40, 1000]"
    if len(edges) < 2:
        raise ValueError(f"length bucket edges {edges} need at least two values, {example}.")
    if any(not isinstance(e, int) or isinstance(e, bool) for e in edges):
        raise ValueError(f"length bucket edges {edges} must all be ints, {example}.")
    if edges[0] != 0:
        raise ValueError(
            f"length bucket edges {edges} must start at 0 so every length has a bucket, {example}."
        )
    if any(b <= a for a, b in pairwise(edges)):
        raise ValueError(f"length bucket edges {edges} must be strictly increasing, {example}.")


def bucket_names(edges: Sequence[int]) -> list[str]:
    """Names of the buckets defined by ``edges``, in order.

    Bucket ``i`` holds lengths in ``[edges[i], edges[i+1])``, except the last, which is
    open-ended: the final edge only marks where the reported range nominally ends, and longer
    sentences still land in the last bucket so none is ever lost.

    Args:
        edges: Valid edges (see :func:`check_edges`), e.g. ``[0, 10, 20, 1000]``.

    Returns:
        E.g. ``["len0-10", "len10-20", "len20+"]`` (``len0-10`` means 0 <= length < 10).
    """
    check_edges(edges)
    names = [f"len{a}-{b}" for a, b in zip(edges[:-2], edges[1:-1], strict=True)]
    names.append(f"len{edges[-2]}+")
    return names


def bucket_of(length: int, edges: Sequence[int]) -> str:
    """The name of the one bucket that ``length`` falls into (see :func:`bucket_names`).

    Args:
        length: A non-negative sequence length in tokens.
        edges: Valid bucket edges, e.g. ``[0, 10, 20, 30, 40, 1000]``.

    Returns:
        E.g. ``bucket_of(10, [0, 10, 20, 1000]) == "len10-20"``; 25 and 5000 give ``"len20+"``.

    Raises:
        ValueError: ``length`` is negative or the edges are invalid.
    """
    check_edges(edges)
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}.")
    for a, b in zip(edges[:-2], edges[1:-1], strict=True):
        if a <= length < b:
            return f"len{a}-{b}"
    return f"len{edges[-2]}+"


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


def _pack(order: Sequence[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Greedily cut an ordered index list into batches with size * max_length <= max_tokens.

    A single example longer than ``max_tokens`` becomes a batch of its own rather than being
    lost; the data module prevents that for training data.
    """
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        length = max(1, lengths[i])
        new_longest = max(longest, length)
        if batch and (len(batch) + 1) * new_longest > max_tokens:
            batches.append(batch)
            batch, new_longest = [], length
        batch.append(i)
        longest = new_longest
    if batch:
        batches.append(batch)
    return batches


class TokenBucketSampler(Sampler[list[int]]):
    """Yields batches of dataset indices whose padded size stays within a token budget.

    Every batch satisfies ``len(batch) * max(lengths[i] for i in batch) <= max_tokens``
    (except a single example longer than the budget, which is yielded alone).

    With ``shuffle=True`` each epoch: the indices are randomly permuted, cut into chunks of
    ``chunk_size``, each chunk is sorted by length (stable, so equal lengths stay in random
    order) and packed, and the batch order is shuffled. All randomness comes from
    ``seed + epoch``, so a run is reproducible and :meth:`set_epoch` changes the order.
    With ``shuffle=False`` all indices are sorted by length (ties by index) and batches come
    shortest first, which is what evaluation wants.

    ``chunk_size=None`` (the default) uses one chunk holding everything. Then the number of
    batches depends only on the multiset of lengths and is the same every epoch, which matters
    because Lightning reads ``len(dataloader)`` once and ends every epoch after that many
    batches: with smaller chunks the count varies by epoch, so an epoch that packs into more
    batches than the first one would skip its last batches.

    Use it as the ``sampler`` of a ``DataLoader`` with ``batch_size=None`` (the dataset's
    ``__getitem__`` then receives index lists), so Lightning finds it and calls ``set_epoch``.

    Args:
        lengths: Per-example cost in tokens (for translation, the longer of the padded source
            and decoder sequences).
        max_tokens: Token budget per batch (batch size times longest length in the batch).
        shuffle: Shuffle (training) or sort deterministically (evaluation).
        seed: Base seed of the per-epoch shuffling.
        chunk_size: Examples per sorting chunk when shuffling; ``None`` means all of them.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        shuffle: bool,
        seed: int = 0,
        chunk_size: int | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens}.")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(
                f"chunk_size must be a positive int or None (one chunk), got {chunk_size}."
            )
        if any(length < 0 for length in lengths):
            raise ValueError("lengths must be non-negative token counts.")
        self.lengths = list(lengths)
        self.max_tokens = int(max_tokens)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.chunk_size = chunk_size
        self.epoch = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffled order :meth:`__iter__` yields next."""
        self.epoch = int(epoch)

    def batches(self) -> list[list[int]]:
        """All batches of the current epoch, in the order they will be yielded."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        n = len(self.lengths)
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: (self.lengths[i], i))
            batches = _pack(order, self.lengths, self.max_tokens)
        else:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(n, generator=gen).tolist()
            size = n if self.chunk_size is None else self.chunk_size
            batches = []
            for start in range(0, n, max(size, 1)):
                chunk = sorted(perm[start : start + size], key=self.lengths.__getitem__)
                batches.extend(_pack(chunk, self.lengths, self.max_tokens))
            batches = [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        self._cache = (self.epoch, batches)
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())


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
        settings = {k: v for k, v in self.tokenizer_cfg.items() if k != "kind"}
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
            costs, self.max_tokens, shuffle=shuffle, seed=self.seed, chunk_size=self.shuffle_chunk
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
