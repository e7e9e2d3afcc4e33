"""Samplers for evaluation under DDP."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import cast

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler


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
