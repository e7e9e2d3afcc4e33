"""Samplers. Training: the batches of a step depend only on the step, whatever stopped
and resumed the run, and each DDP rank draws its own ones (:class:`TrainingSampler`,
:class:`BatchIndexSampler`; by token budget with length bucketing for translation,
:class:`TokenBucketSampler`). Evaluation: shards that take every item exactly once
(:class:`ShardSampler`, and :class:`TokenBucketSampler` without shuffling).

Every sampler here is a ``DistributedSampler`` that splits its work over the ranks itself,
so Lightning leaves it in place instead of wrapping it in its own, which pads evaluation
shards with repeated items and, in training, would index a resumed iteration out of range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

#: Batches per epoch (per rank) of language modeling, whose training data is an endless
#: stream: its epoch is only a unit of Lightning's loop.
EPOCH_STEPS = 1000

#: Batches in the single epoch of a run whose data never repeats (algorithmic problems):
#: ``max_steps`` ends it. One epoch, whatever ``max_steps``: each epoch's iterator draws
#: once from the global generator, so more epochs would move the dropout masks and random
#: positions of every later step, and a run continued to more steps would part from one
#: that was that long from the start.
ENDLESS = 1 << 40

#: What a training sampler reads when an iteration starts: the optimizer steps taken so
#: far and ``accumulate_grad_batches`` (see :func:`trainer_progress`).
Progress = Callable[[], tuple[int, int]]


def trainer_progress(owner: object) -> Progress:
    """The progress of the trainer attached to ``owner`` (a data module), read when called;
    ``(0, 1)`` while none is attached. Lightning restores the step of a checkpoint before it
    iterates the training loader, so a resumed run reads where it stopped."""

    def read() -> tuple[int, int]:
        trainer = getattr(owner, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_step), int(trainer.accumulate_grad_batches)

    return read


def position(steps: int, accumulate: int, epoch_steps: int) -> tuple[int, int]:
    """The epoch, and the batch within it, that a rank has reached after ``steps`` optimizer
    steps.

    Lightning steps the optimizer after every ``accumulate`` batches and after the last
    batch of an epoch, so an epoch of ``n`` batches takes ``ceil(n / accumulate)`` steps
    (posenc's training epochs are multiples of ``accumulate``: see
    :meth:`TrainingSampler.epoch_steps`).

    Args:
        steps: Optimizer steps taken (``trainer.global_step``).
        accumulate: ``trainer.accumulate_grad_batches``.
        epoch_steps: Batches per epoch (this rank's), the same every epoch.

    Returns:
        ``(epoch, batch)``: the next batch to draw is batch ``batch`` of epoch ``epoch``.
    """
    if accumulate < 1:
        raise ValueError(f"accumulate must be a positive int, got {accumulate}.")
    per_epoch = max(-(-epoch_steps // accumulate), 1)
    epoch, rest = divmod(steps, per_epoch)
    return epoch, rest * accumulate


class _RankAware(DistributedSampler):
    """A ``DistributedSampler`` that reads the world size and rank when iterating, not when
    built: a loader may be built before Lightning starts the process group (``trainer.test``
    in an ``eval_only`` run launches the ranks)."""

    def __init__(self, *, shuffle: bool, seed: int = 0) -> None:
        # DistributedSampler.__init__ is skipped on purpose: it needs a process group now.
        self.shuffle = shuffle  # read by Lightning to decide whether a loader shuffles
        self.drop_last = shuffle
        self.seed = int(seed)
        self.epoch = 0

    @property
    def num_replicas(self) -> int:  # type: ignore[override]
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @property
    def rank(self) -> int:  # type: ignore[override]
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch a sampler without a progress function iterates (Lightning calls this
        every epoch; training samplers with one follow the trainer's step instead)."""
        self.epoch = int(epoch)


def all_ranks(items: list[Any]) -> list[Any]:
    """``items`` of every rank, concatenated in rank order (this rank's alone outside DDP):
    the outputs of an evaluation whose shards each rank decoded."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(items)
    gathered: list[list[Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in (part or [])]


class ShardSampler(_RankAware):
    """Rank ``r`` of ``W`` takes items ``r, r + W, r + 2W, ...``: every item exactly once.

    torch's ``DistributedSampler`` repeats items so that every rank gets the same number;
    summed metrics (``TokenNLL``) would then score those windows twice and a 2-process
    perplexity would differ from the 1-process one. Here ranks may differ by one item,
    which evaluation tolerates: it runs no collective per batch, only the metric sync at
    the end of the epoch, which every rank reaches.

    Args:
        dataset: The dataset to shard (only its length is used).
    """

    def __init__(self, dataset: Sized) -> None:
        super().__init__(shuffle=False)
        self.dataset = cast(Dataset, dataset)  # the base class's type; only len() is read

    def _indices(self) -> range:
        return range(self.rank, len(cast(Sized, self.dataset)), self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices())

    def __len__(self) -> int:
        return len(self._indices())


class TrainingSampler(_RankAware):
    """Training: each iteration starts where the trainer is, so that the batch of a step
    depends only on the step.

    An iteration (an epoch) reads ``progress()`` and draws from the batch :func:`position`
    names to the end of that epoch. So a run resumed from a checkpoint draws the batches an
    uninterrupted one draws, wherever in an epoch it stopped, and gradient accumulation
    does not draw a batch twice (a global step counts ``accumulate_grad_batches`` batches).
    Without ``progress`` an iteration is the whole epoch :meth:`set_epoch` chose.

    Every epoch has the same number of batches, a multiple of ``accumulate_grad_batches``
    (:meth:`epoch_steps`): Lightning reads ``len()`` once as the length of every epoch, and
    counts accumulation within an epoch but validation intervals across epochs, so an
    accumulation window never spans two epochs and validation falls between two steps.
    Subclasses give the count before that rounding (:meth:`base_steps`) and what a step
    yields (:meth:`items`).

    Args:
        progress: :func:`trainer_progress` of the data module, or None.
        seed: Base seed.
    """

    def __init__(self, progress: Progress | None = None, seed: int = 0) -> None:
        super().__init__(shuffle=True, seed=seed)
        self.progress = progress

    def base_steps(self) -> int:
        """This rank's batches in an epoch, before rounding up to whole steps."""
        raise NotImplementedError

    def items(self, epoch: int, step: int) -> Iterable[Any]:
        """What this rank yields for batch ``step`` of ``epoch``."""
        raise NotImplementedError

    def accumulate(self) -> int:
        """Batches a step (``trainer.accumulate_grad_batches``; 1 without a trainer)."""
        return self.progress()[1] if self.progress is not None else 1

    def epoch_steps(self) -> int:
        """This rank's batches in every epoch: :meth:`base_steps`, rounded up to a multiple
        of :meth:`accumulate` (unchanged without accumulation)."""
        a = self.accumulate()
        return -(-self.base_steps() // a) * a

    def start(self) -> tuple[int, int]:
        """The epoch and batch the next iteration starts at."""
        if self.progress is None:
            return self.epoch, 0
        steps, accumulate = self.progress()
        return position(steps, accumulate, self.epoch_steps())

    def __iter__(self) -> Iterator[Any]:
        epoch, first = self.start()
        for step in range(first, self.epoch_steps()):
            yield from self.items(epoch, step)

    def __len__(self) -> int:
        return self.epoch_steps()


class BatchIndexSampler(TrainingSampler):
    """The global index of each training batch, for a dataset whose item ``j`` is batch ``j``
    of an endless stream: rank ``r`` of ``W`` at batch ``s`` of epoch ``e`` draws batch
    ``(e * E + s) * W + r`` (``E`` = :meth:`epoch_steps`), so the ranks never draw the same
    batch and one process draws batch ``j`` at its ``j``-th training batch.

    Args:
        steps: Batches per epoch, per rank (rounded up to whole steps).
        progress: :func:`trainer_progress`, or None.
    """

    def __init__(self, steps: int, progress: Progress | None = None, seed: int = 0) -> None:
        super().__init__(progress, seed)
        self.steps = int(steps)

    def base_steps(self) -> int:
        return self.steps

    def batch_index(self, epoch: int, step: int) -> int:
        """The global index of this rank's batch ``step`` of ``epoch``."""
        return (epoch * self.epoch_steps() + step) * self.num_replicas + self.rank

    def items(self, epoch: int, step: int) -> Iterable[Any]:
        return (self.batch_index(epoch, step),)


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


class TokenBucketSampler(TrainingSampler):
    """Yields batches of dataset indices whose padded size stays within a token budget.

    Every batch satisfies ``len(batch) * max(lengths[i] for i in batch) <= max_tokens``
    (except a single example longer than the budget, which is yielded alone).

    With ``shuffle=True`` (training) each epoch: the indices are randomly permuted, cut into
    chunks of ``chunk_size``, each chunk is sorted by length (stable, so equal lengths stay
    in random order) and packed, and the batch order is shuffled. All randomness comes from
    ``seed + epoch``, so a run is reproducible. Rank ``r`` of ``W`` takes batches
    ``r, r + W, ...`` of the epoch, the same number on every rank (the last
    ``len % W`` batches of an epoch, a different few each epoch, are left out). Which epoch
    and batch an iteration starts at follows the trainer (:class:`TrainingSampler`).
    With ``shuffle=False`` (evaluation) all indices are sorted by length (ties by index),
    batches come shortest first, and rank ``r`` takes batches ``r, r + W, ...``: every
    example exactly once.

    ``chunk_size=None`` (the default) uses one chunk holding everything. Then the number of
    batches depends only on the multiset of lengths and is the same every epoch. With
    smaller chunks it varies by epoch, and since Lightning reads ``len(dataloader)`` once,
    every training epoch has epoch 0's count (rounded up to whole steps with gradient
    accumulation): a longer epoch stops there, a shorter one repeats its first batches.

    Use it as the ``sampler`` of a ``DataLoader`` with ``batch_size=None`` (the dataset's
    ``__getitem__`` then receives index lists).

    Args:
        lengths: Per-example cost in tokens (for translation, the longer of the padded source
            and decoder sequences).
        max_tokens: Token budget per batch (batch size times longest length in the batch).
        shuffle: Shuffle (training) or sort deterministically (evaluation).
        seed: Base seed of the per-epoch shuffling.
        chunk_size: Examples per sorting chunk when shuffling; ``None`` means all of them.
        progress: For training, :func:`trainer_progress` of the data module; None iterates
            the epoch :meth:`set_epoch` chose from its start.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        shuffle: bool,
        seed: int = 0,
        chunk_size: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens}.")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(
                f"chunk_size must be a positive int or None (one chunk), got {chunk_size}."
            )
        if any(length < 0 for length in lengths):
            raise ValueError("lengths must be non-negative token counts.")
        super().__init__(progress, seed)
        self.shuffle = self.drop_last = shuffle
        self.lengths = list(lengths)
        self.max_tokens = int(max_tokens)
        self.chunk_size = chunk_size
        self._cache: dict[int, list[list[int]]] = {}  # epoch 0's and the latest epoch's
        self._epoch_cache: tuple[int, int, list[list[int]]] = (-1, 0, [])

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of ``epoch`` (default: the one :meth:`set_epoch` chose) over all
        ranks, in order."""
        epoch = self.epoch if epoch is None else epoch
        if epoch in self._cache:
            return self._cache[epoch]
        n = len(self.lengths)
        if not self.shuffle:
            order = sorted(range(n), key=lambda i: (self.lengths[i], i))
            batches = _pack(order, self.lengths, self.max_tokens)
        else:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            perm = torch.randperm(n, generator=gen).tolist()
            size = n if self.chunk_size is None else self.chunk_size
            batches = []
            for start in range(0, n, max(size, 1)):
                chunk = sorted(perm[start : start + size], key=self.lengths.__getitem__)
                batches.extend(_pack(chunk, self.lengths, self.max_tokens))
            batches = [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]
        self._cache = {e: b for e, b in self._cache.items() if e == 0} | {epoch: batches}
        return batches

    def base_steps(self) -> int:
        n, ranks = len(self.batches(0)), self.num_replicas
        if n < ranks:
            raise ValueError(
                f"the training data packs into {n} batches of max_tokens={self.max_tokens}, "
                f"fewer than the {ranks} processes; lower max_tokens or use fewer devices."
            )
        return n // ranks

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All ranks' batches of ``epoch``: its shuffled batches, cut or cycled to
        :meth:`epoch_steps` per rank (an epoch that packs into fewer than epoch 0, with
        ``chunk_size``, or into fewer than whole steps, repeats its first batches)."""
        need = self.epoch_steps() * self.num_replicas
        if self._epoch_cache[:2] != (epoch, need):
            batches = self.batches(epoch)
            self._epoch_cache = (epoch, need, [batches[i % len(batches)] for i in range(need)])
        return self._epoch_cache[2]

    def items(self, epoch: int, step: int) -> Iterable[list[int]]:
        return (self.epoch_batches(epoch)[step * self.num_replicas + self.rank],)

    def _shard(self) -> list[list[int]]:
        """Evaluation: this rank's batches, ``r, r + W, ...``; a set of fewer batches than
        ranks goes one example a batch, so that every rank has one."""
        batches, ranks = self.batches(), self.num_replicas
        if len(batches) < ranks:
            batches = [[i] for batch in batches for i in batch]
        if len(batches) < ranks:
            raise ValueError(
                f"{len(batches)} examples cannot be split over {ranks} processes; "
                f"evaluate with fewer devices."
            )
        return batches[self.rank :: ranks]

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            return super().__iter__()
        return iter(self._shard())

    def __len__(self) -> int:
        if self.shuffle:
            return super().__len__()
        return len(self._shard())
