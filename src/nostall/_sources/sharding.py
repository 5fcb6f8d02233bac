"""Splitting a DataLoader between the ranks of a distributed run (``prefetch(shard=True)``).

Frameworks shard only what they recognise: Lightning injects a ``DistributedSampler`` by
re-instantiating objects that are ``torch.utils.data.DataLoader`` instances, so a prefetcher
handed to ``Trainer.fit`` would give every rank the whole dataset. ``shard=True`` does the
injection itself, the way Lightning would, once ``torch.distributed`` is initialised; without
it, an unsharded loader in a multi-rank run gets a warning that names the fix.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)

from .._torch_compat import copy_loader
from .sources import classify


def distributed_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` in an initialised process group of more than one rank, else None."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world) if world > 1 else None


def is_sharded(loader: object) -> bool:
    """True when the loader already gives each rank its own part of the data.

    A ``DistributedSampler`` (or subclass) as its sampler or its batch sampler's sampler, a batch
    sampler or sampler that knows its ranks (accelerate's ``BatchSamplerShard`` has
    ``num_processes``), or an iterable dataset, which must split itself.
    """
    kind = classify(loader)
    if kind.loader is not None and not kind.map_style:
        return True
    batch_sampler = getattr(loader, "batch_sampler", None)
    for part in (
        getattr(loader, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
    ):
        if isinstance(part, DistributedSampler):
            return True
        for ranks in (getattr(part, "num_processes", None), getattr(part, "num_replicas", None)):
            if isinstance(ranks, int) and ranks > 1:
                return True
    return False


def check_shardable(loader: object) -> None:
    """Refuse, at construction, a source that ``shard=True`` cannot split."""
    kind = classify(loader)
    if kind.loader is None or not kind.dataloader_type:
        raise TypeError(
            f"shard=True splits a torch.utils.data.DataLoader between ranks (got a "
            f"{type(loader).__qualname__}); give that loader a DistributedSampler yourself, or "
            f"pass shard=False"
        )
    loader = kind.loader
    if not kind.map_style:
        raise ValueError(
            "shard=True cannot split an IterableDataset between ranks: each rank must read its "
            "own part inside the dataset (see torch.utils.data.get_worker_info and "
            "torch.distributed.get_rank); pass shard=False"
        )
    if is_sharded(loader):
        return
    sampler = _base_sampler(loader)
    if not isinstance(sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            f"shard=True replaces a SequentialSampler or RandomSampler with a "
            f"DistributedSampler; this loader's sampler is a {type(sampler).__qualname__}. "
            f"Make it distributed yourself (e.g. DistributedSampler, or a sampler that takes "
            f"rank and num_replicas) and pass shard=False"
        )
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        raise ValueError(
            f"shard=True cannot split a custom batch_sampler "
            f"({type(loader.batch_sampler).__qualname__}); give it a DistributedSampler "
            f"yourself and pass shard=False"
        )


def _base_sampler(loader: DataLoader[Any]) -> object:
    if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
        return getattr(loader.batch_sampler, "sampler", None)
    return loader.sampler


def shard_loader(loader: DataLoader[Any], rank: int, world: int) -> DataLoader[Any]:
    """A copy of ``loader`` whose sampler is a ``DistributedSampler`` for ``rank`` of ``world``.

    Built as Lightning builds the sampler it injects (``shuffle`` when the loader's sampler is a
    ``RandomSampler``, ``seed`` from ``PL_GLOBAL_SEED`` or 0, ``drop_last=False``), so a run with
    a prefetcher sees the same indices per rank and epoch as one with Lightning's own
    injection. The user's loader is left as it is.
    """
    sampler: DistributedSampler[Any] = DistributedSampler(
        loader.dataset,
        num_replicas=world,
        rank=rank,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
    )
    if loader.batch_sampler is None:
        return copy_loader(loader, sampler=sampler)
    batch_sampler = BatchSampler(
        sampler,
        loader.batch_sampler.batch_size,  # type: ignore[attr-defined]
        loader.drop_last,
    )
    return copy_loader(loader, sampler=sampler, batch_sampler=batch_sampler)


def sharded_copy(loader: object) -> DataLoader[Any] | None:
    """With ``shard=True``: ``loader``'s sharded copy once ``torch.distributed`` is up, else None.

    None too when it is sharded already. The caller decides when a copy may replace the loader
    (between epochs, never during one).
    """
    world = distributed_world()
    if world is None or is_sharded(loader):
        return None
    return shard_loader(loader, *world)  # type: ignore[arg-type]


def unsharded_warning(loader: object, rank: int, world: int) -> str:
    """The message for a loader that would give every rank all of its data."""
    return (
        f"nostall: torch.distributed runs {world} ranks (this is rank {rank}), but the loader "
        f"given to nostall.prefetch has no DistributedSampler, so every rank loads all of its "
        f"data. A framework that injects one into DataLoaders (Lightning) cannot see it "
        f"through the prefetcher. Pass shard=True to nostall.prefetch to split it the way "
        f"Lightning does, or build the DataLoader with sampler=DistributedSampler(dataset); "
        f"pass shard=False if every rank should see all of it"
    )
