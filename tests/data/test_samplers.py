"""Samplers: evaluation shards take every item exactly once over the ranks, no padding;
training samplers start where Lightning's loop is and split batches over the ranks."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from posenc.data.samplers import BatchIndexSampler, ShardSampler, TokenBucketSampler, position


def test_single_process_yields_everything_in_order() -> None:
    sampler = ShardSampler(range(13))
    assert list(sampler) == list(range(13)) and len(sampler) == 13
    assert isinstance(sampler, DistributedSampler)  # so Lightning leaves it in place
    assert not sampler.shuffle


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ranks_partition_the_items_without_padding(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    shards = []
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        sampler = ShardSampler(range(13))
        shards.append(list(sampler))
        assert len(sampler) == len(shards[-1])
    assert sorted(i for shard in shards for i in shard) == list(range(13))
    # torch's DistributedSampler pads to 14 (world 2) or 15, 16: that is what is avoided.
    assert sum(map(len, shards)) == 13


def _lightning_positions(epochs: int, n: int, accumulate: int) -> list[tuple[int, int]]:
    """Where a rank is after each optimizer step, walking the loop as Lightning runs it
    over epochs of ``n`` batches: a step after every ``accumulate`` batches of an epoch and
    after its last batch."""
    at = [(0, 0)]
    for epoch in range(epochs):
        for batch in range(n):
            if (batch + 1) % accumulate == 0 or batch == n - 1:
                at.append((epoch + 1, 0) if batch == n - 1 else (epoch, batch + 1))
    return at


@pytest.mark.parametrize("accumulate", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [4, 5, 7])
def test_position_is_where_lightnings_loop_is_after_each_step(accumulate: int, n: int) -> None:
    expected = _lightning_positions(4, n, accumulate)
    for steps, at in enumerate(expected[:-1]):
        assert position(steps, accumulate, n) == at, steps
    assert position(5, 2, 4) == (2, 2)  # 2 steps an epoch: 5 = 2 + 2 + 1


def test_training_epochs_are_whole_steps() -> None:
    """An epoch is a multiple of accumulate_grad_batches, so that no accumulation window
    spans two epochs (Lightning steps at an epoch's end) and validation, counted in
    batches across epochs, falls between two steps."""
    assert len(BatchIndexSampler(5)) == len(BatchIndexSampler(5, progress=lambda: (0, 1))) == 5
    sampler = BatchIndexSampler(5, progress=lambda: (0, 2))
    assert len(sampler) == 6 and list(sampler) == list(range(6))
    sampler.progress = lambda: (3, 2)  # 3 steps of 2: the next epoch
    assert list(sampler) == list(range(6, 12))
    rng = random.Random(0)
    lengths = [rng.randint(1, 30) for _ in range(400)]
    plain = TokenBucketSampler(lengths, 120, shuffle=True, seed=1, progress=lambda: (0, 1))
    n = len(plain)
    three = TokenBucketSampler(lengths, 120, shuffle=True, seed=1, progress=lambda: (0, 3))
    whole = -(-n // 3) * 3
    assert len(three) == whole and list(three) == [*list(plain), *list(plain)][:whole]


def _ranks(world: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: world)
    for rank in range(world):
        monkeypatch.setattr(dist, "get_rank", lambda rank=rank: rank)
        yield rank


@pytest.mark.parametrize("world", [2, 3])
def test_training_ranks_draw_distinct_batches_and_as_many(
    world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = list(BatchIndexSampler(6))
    assert one == list(range(6)) and isinstance(BatchIndexSampler(6), DistributedSampler)
    drawn = []
    for _ in _ranks(world, monkeypatch):
        sampler = BatchIndexSampler(6, progress=lambda: (8, 1))  # 8 steps: epoch 1, batch 2
        drawn.append(list(sampler))
        assert len(sampler) == 6 and len(drawn[-1]) == 4
    assert sorted(sum(drawn, [])) == list(range(8 * world, 12 * world))


@pytest.mark.parametrize("world", [2, 3])
def test_token_buckets_split_over_ranks(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 30) for _ in range(400)]
    epoch = TokenBucketSampler(lengths, 120, shuffle=True, seed=1).batches(0)
    train, evaluation = [], []
    for _ in _ranks(world, monkeypatch):
        sampler = TokenBucketSampler(lengths, 120, shuffle=True, seed=1, progress=lambda: (0, 1))
        train.append(list(sampler))
        assert len(sampler) == len(train[-1]) == len(epoch) // world  # the same on every rank
        evaluation.append(list(TokenBucketSampler(lengths, 120, shuffle=False)))
    # Training: distinct batches of the epoch, all but the last len % world of them.
    assert sorted(map(tuple, sum(train, []))) == sorted(map(tuple, epoch[: len(train[0]) * world]))
    # Evaluation: every example once, no padding.
    assert sorted(i for shard in evaluation for b in shard for i in b) == list(range(400))
