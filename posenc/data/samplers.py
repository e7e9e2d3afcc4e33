"""Samplers: batches by token budget with length bucketing (translation training and
evaluation), and shards for evaluation under DDP."""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Sized
from typing import cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler


class ShardSampler(DistributedSampler):
    """Rank ``r`` of ``W`` takes items ``r, r + W, r + 2W, ...``: every item exactly once.

    torch's ``DistributedSampler`` repeats items so that every rank gets the same number;
    summed metrics (``TokenNLL``) would then score those windows twice and a 2-process
    perplexity would differ from the 1-process one. Here ranks may differ by one item,
    which evaluation tolerates: it runs no collective per batch, only the metric sync at
    the end of the epoch, which every rank reaches.

    Being a ``DistributedSampler`` subclass tells Lightning the loader is already sharded,
    so it does not wrap it in a padding sampler. The world size and rank are read when
    iterating, not here, because a loader may be built before Lightning starts the process
    group (``trainer.test`` in an ``eval_only`` run launches the ranks).

    Args:
        dataset: The dataset to shard (only its length is used).
    """

    def __init__(self, dataset: Sized) -> None:
        # DistributedSampler.__init__ is skipped on purpose: it needs a process group now.
        self.dataset = cast(Dataset, dataset)  # the base class's type; only len() is read
        self.shuffle = False  # read by Lightning to decide whether a loader shuffles
        self.drop_last = False
        self.seed = 0
        self.epoch = 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:  # type: ignore[override]
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _indices(self) -> range:
        return range(self.rank, len(cast(Sized, self.dataset)), self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())

    def set_epoch(self, epoch: int) -> None:
        """Kept for the ``DistributedSampler`` interface; the order never changes."""
        self.epoch = epoch


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
