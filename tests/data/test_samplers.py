"""ShardSampler: every item exactly once over the ranks, no padding."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from posenc.data.samplers import ShardSampler


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
