"""prefetch(shard=...): splitting a DataLoader between ranks, and the warning when it is not."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import as_dataset, assert_torchrun_finished, run_torchrun
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, WeightedRandomSampler

import nostall
from nostall._sources import checks as _source_checks
from nostall._sources import sharding as _sharding


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """Pretend torch.distributed is initialised with ``world`` ranks, this one ``rank``."""
    monkeypatch.setattr(_sharding, "distributed_world", lambda: (rank, world))
    monkeypatch.setattr(_source_checks, "distributed_world", lambda: (rank, world))


def indices(batches: Any) -> list[int]:
    return [int(i) for b in batches for i in b]


def lightning_like(loader: DataLoader[int], rank: int, world: int, epoch: int) -> list[int]:
    """What Lightning injects: DistributedSampler(shuffle=..., seed=PL_GLOBAL_SEED)."""
    sampler: DistributedSampler[int] = DistributedSampler(
        loader.dataset,
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
    loader = DataLoader(as_dataset(list(range(21))), batch_size=4, shuffle=shuffle)
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
        p = nostall.prefetch(
            DataLoader(as_dataset(list(range(20))), batch_size=3, shuffle=True), shard=True
        )
        seen += indices(p)
        p.close()
    assert list(range(20)) == sorted(seen)


def test_unsharded_loader_in_a_multi_rank_run_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank would load all the data: the warning names DistributedSampler and shard=."""
    as_rank(monkeypatch, 0, 2)
    p = nostall.prefetch(DataLoader(as_dataset(list(range(8))), batch_size=2), "cpu")
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
        p = nostall.prefetch(DataLoader(as_dataset(data), batch_size=2), "cpu", shard=False)
        assert data == indices(p)
    else:
        sampler: DistributedSampler[int] = DistributedSampler(
            as_dataset(data), num_replicas=2, rank=0, shuffle=False
        )
        p = nostall.prefetch(
            DataLoader(as_dataset(data), batch_size=2, sampler=sampler), "cpu", shard=True
        )
        assert [0, 2, 4, 6] == indices(p)
    p.close()


def test_shard_true_in_a_single_process_changes_nothing() -> None:
    """Without a process group of several ranks, the loader is used as it is."""
    p = nostall.prefetch(DataLoader(as_dataset(list(range(6))), batch_size=2), "cpu", shard=True)
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
        nostall.prefetch(DataLoader(as_dataset(list(range(4))), sampler=weighted), shard=True)
    with pytest.raises(TypeError, match=r"shard=\.\.\.\) must be True, False or None"):
        nostall.prefetch(DataLoader(list(range(4))), shard="yes")  # type: ignore[arg-type]


# -- the process group comes up after an epoch ran (a sanity pass first) -------------------------


@pytest.mark.parametrize(("threads", "across_epochs"), [(None, False), (2, False), (None, True)])
def test_epochs_after_the_group_came_up_are_sharded(
    monkeypatch: pytest.MonkeyPatch, threads: int | None, across_epochs: bool
) -> None:
    """An epoch before init loads everything; each epoch set after it gets this rank's part."""
    loader = DataLoader(as_dataset(list(range(21))), batch_size=4, shuffle=True)
    p = nostall.prefetch(loader, "cpu", shard=True, threads=threads, across_epochs=across_epochs)
    assert list(range(21)) == sorted(indices(p))  # no world yet: the whole loader
    as_rank(monkeypatch, 1, 2)  # init_process_group
    for epoch in (1, 2):
        p.set_epoch(epoch)
        assert lightning_like(loader, 1, 2, epoch) == indices(p)
    p.close()


def test_epoch_under_way_when_the_group_came_up_ends_unsharded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The epoch begun before init ends as it began; the next one is sharded, at epoch 1."""
    loader = DataLoader(as_dataset(list(range(20))), batch_size=4, shuffle=True)
    p = nostall.prefetch(loader, "cpu", shard=True)
    it = iter(p)
    first = next(it)
    as_rank(monkeypatch, 0, 2)
    assert 5 == len(p)  # the loader's length until this epoch ends
    assert list(range(20)) == sorted(indices([first, *it]))
    assert lightning_like(loader, 0, 2, 1) == indices(p)  # no set_epoch: nostall counted 1
    p.close()


def test_state_saved_once_the_group_came_up_resumes_the_shard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A state saved between the unsharded epoch and the first sharded one resumes the latter."""
    p = nostall.prefetch(
        DataLoader(as_dataset(list(range(20))), batch_size=4, shuffle=True), shard=True
    )
    indices(p)
    as_rank(monkeypatch, 0, 2)
    state = p.state_dict()  # before epoch 1, which nostall counted (no set_epoch)
    expected = indices(p)
    p.close()
    again = nostall.prefetch(
        DataLoader(as_dataset(list(range(20))), batch_size=4, shuffle=True), shard=True
    )
    again.load_state_dict(state)
    assert expected == indices(again)
    again.close()


SANITY_THEN_DDP = """
import torch, torch.distributed as dist
from torch.utils.data import DataLoader
import nostall
loader = DataLoader(list(range(40)), batch_size=4, shuffle=True,
                    generator=torch.Generator().manual_seed(0))
batches = nostall.prefetch(loader, "cpu", shard=True, threads=2)
seen = {0: [int(x) for b in batches for x in b]}  # a sanity pass, before the process group
dist.init_process_group("gloo")
for epoch in (1, 2):
    batches.set_epoch(epoch)
    seen[epoch] = [int(x) for b in batches for x in b]
out = [None] * dist.get_world_size()
dist.all_gather_object(out, seen)
if dist.get_rank() == 0:
    print("SEEN", out)
rank = dist.get_rank()
dist.destroy_process_group()
print(f"rank {rank}: done", flush=True)
"""


@pytest.mark.timeout(200)
def test_two_gloo_ranks_shard_every_epoch_after_init(tmp_path: Path) -> None:
    """torchrun, two ranks, threads=2: the sanity epoch before init loads all; then halves.

    Disjoint halves each epoch, and each epoch's own (set_epoch reached the sampler).
    """
    script = tmp_path / "run.py"
    script.write_text(SANITY_THEN_DDP)
    done = run_torchrun(script, timeout=150)
    assert_torchrun_finished(done, ["rank 0: done", "rank 1: done"])
    line = next(x for x in done.stdout.splitlines() if x.startswith("SEEN"))
    ranks = ast.literal_eval(line[len("SEEN ") :])  # [{epoch: samples}], printed by rank 0
    for rank in ranks:
        assert list(range(40)) == sorted(rank[0])
    for epoch in (1, 2):
        first, second = (set(r[epoch]) for r in ranks)
        assert (20, 20) == (len(first), len(second))
        assert set(range(40)) == first | second
    assert ranks[0][1] != ranks[0][2]
