"""prefetch(shard=...): splitting a DataLoader between ranks, and the warning when it is not."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, WeightedRandomSampler

import nostall
from nostall import _sharding, _source_checks


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """Pretend torch.distributed is initialised with ``world`` ranks, this one ``rank``."""
    monkeypatch.setattr(_sharding, "distributed_world", lambda: (rank, world))
    monkeypatch.setattr(_source_checks, "distributed_world", lambda: (rank, world))


def indices(batches: Any) -> list[int]:
    return [int(i) for b in batches for i in b]


def lightning_like(loader: DataLoader[int], rank: int, world: int, epoch: int) -> list[int]:
    """What Lightning injects: DistributedSampler(shuffle=..., seed=PL_GLOBAL_SEED)."""
    sampler = DistributedSampler(
        loader.dataset,  # type: ignore[arg-type]
        num_replicas=world,
        rank=rank,
        shuffle=isinstance(loader.sampler, torch.utils.data.RandomSampler),
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
    )
    sampler.set_epoch(epoch)
    again = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)
    return indices(again)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_shard_true_gives_each_rank_what_lightning_would(
    monkeypatch: pytest.MonkeyPatch, rank: int, shuffle: bool
) -> None:
    """Per rank and epoch, the indices of a DistributedSampler built as Lightning builds it."""
    as_rank(monkeypatch, rank, 2)
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")  # Lightning's seed_everything() exports it
    loader = DataLoader(list(range(21)), batch_size=4, shuffle=shuffle)
    p = nostall.prefetch(loader, "cpu", shard=True, across_epochs=True)
    assert 3 == len(p)  # 11 of 21 samples on this rank, in batches of 4
    assert isinstance(p.sampler, DistributedSampler)
    for epoch in range(3):
        p.sampler.set_epoch(epoch)  # as Lightning does
        assert lightning_like(loader, rank, 2, epoch) == indices(p)
    assert not isinstance(loader.sampler, DistributedSampler)  # the user's loader is untouched
    p.close()


def test_ranks_together_see_every_sample_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two ranks' shards partition the data (DistributedSampler pads to equal length)."""
    seen = []
    for rank in (0, 1):
        as_rank(monkeypatch, rank, 2)
        p = nostall.prefetch(DataLoader(list(range(20)), batch_size=3, shuffle=True), shard=True)
        seen += indices(p)
        p.close()
    assert list(range(20)) == sorted(seen)


def test_unsharded_loader_in_a_multi_rank_run_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank would load all the data: the warning names DistributedSampler and shard=."""
    as_rank(monkeypatch, 0, 2)
    p = nostall.prefetch(DataLoader(list(range(8)), batch_size=2), "cpu")
    with pytest.warns(UserWarning, match=r"no DistributedSampler.*shard=True"):
        assert list(range(8)) == indices(p)
    p.close()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("how", ["shard=False", "DistributedSampler"])
def test_no_warning_when_told_or_already_sharded(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """shard=False, or a loader that already has a DistributedSampler: no warning."""
    as_rank(monkeypatch, 0, 2)
    data = list(range(8))
    if how == "shard=False":
        p = nostall.prefetch(DataLoader(data, batch_size=2), "cpu", shard=False)
        assert data == indices(p)
    else:
        sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)  # type: ignore[arg-type]
        p = nostall.prefetch(DataLoader(data, batch_size=2, sampler=sampler), "cpu", shard=True)
        assert [0, 2, 4, 6] == indices(p)
    p.close()


def test_shard_true_in_a_single_process_changes_nothing() -> None:
    """Without a process group of several ranks, the loader is used as it is."""
    p = nostall.prefetch(DataLoader(list(range(6)), batch_size=2), "cpu", shard=True)
    assert list(range(6)) == indices(p)
    p.close()


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(4))


def test_shard_true_refuses_what_it_cannot_split() -> None:
    """Not a DataLoader, an IterableDataset, a custom sampler: a clear error at construction."""
    with pytest.raises(TypeError, match=r"shard=True splits a torch\.utils\.data\.DataLoader"):
        nostall.prefetch([1, 2], shard=True)
    with pytest.raises(ValueError, match="cannot split an IterableDataset"):
        nostall.prefetch(DataLoader(Stream()), shard=True)
    weighted = WeightedRandomSampler([1.0] * 4, 4)
    with pytest.raises(ValueError, match="WeightedRandomSampler"):
        nostall.prefetch(DataLoader(list(range(4)), sampler=weighted), shard=True)
    with pytest.raises(TypeError, match=r"shard=\.\.\.\) must be True, False or None"):
        nostall.prefetch(DataLoader(list(range(4))), shard="yes")  # type: ignore[arg-type]
