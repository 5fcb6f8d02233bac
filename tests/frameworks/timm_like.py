"""Stand-ins for timm's data loaders (``timm.data.loader``, timm 1.0.31), for tests/test_timm.py.

timm is not installed with the test extras: it imports torchvision, and torchvision's CPU
wheels in our registry do not load with this torch build. These classes behave as timm's do in
what decides which samples a step trains on and which random numbers they get, and are written
here in our own words:

* :class:`PrefetchLoader` mirrors ``timm.data.loader.PrefetchLoader`` on the CPU: its
  ``__iter__`` iterates the inner loader one batch ahead (batch k+1 is taken from the loader,
  normalised and, with ``re_prob``, randomly erased before batch k is yielded); the erasing
  draws from Python's ``random`` (whether and where, as timm's ``RandomErasing`` does) and
  torch's global generator (the ``"pixel"`` fill), in the process and thread that iterates it.
  It forwards ``len()``, ``sampler``, ``batch_sampler`` and ``dataset`` to the inner loader.
* :class:`MultiEpochsDataLoader` and :class:`RepeatSampler` mirror timm's
  ``MultiEpochsDataLoader`` and ``_RepeatSampler``: one iterator of the DataLoader over a batch
  sampler that repeats forever, created at the first ``iter()``; each ``iter()`` takes
  ``len()`` batches of it. A pass's order (a ``RandomSampler`` without a generator) is drawn
  from torch's global generator when the endless iterator reaches that pass: with workers,
  when the main process puts that pass's first indices to a worker, some batches before the
  previous pass ends.
* :func:`worker_init` is timm's ``_worker_init`` with ``worker_seeding="all"``: it seeds NumPy
  from the worker's seed (torch's and ``random`` are seeded by the DataLoader).
* :func:`create_loader` builds what ``timm.data.create_loader`` builds for training, in the
  respects above: ``shuffle=True`` (a ``RandomSampler`` without a generator),
  ``persistent_workers=True`` when ``num_workers > 0``, ``worker_init`` as the
  ``worker_init_fn``, ``drop_last=True``, optionally a ``MultiEpochsDataLoader``, wrapped in a
  ``PrefetchLoader``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info


class Augmented(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples ``(values, index)``; ``draws``: each sample draws its augmentation.

    The values are the index and, with ``draws``, one draw each from torch's global generator,
    Python's ``random`` and NumPy's ``np.random`` (a random crop, flip and jitter would draw
    from them), where ``__getitem__`` runs: in a worker process, or in the process that
    iterates the loader.
    """

    def __init__(self, n: int = 24, draws: bool = True) -> None:
        self.n, self.draws = n, draws

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not self.draws:
            return torch.tensor([float(i), 0.0, 0.0, 0.0]), i
        jitter = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor([float(i), *jitter]), i


def worker_init(worker_id: int) -> None:
    """timm's ``_worker_init(worker_id, worker_seeding="all")``: NumPy from the worker's seed."""
    info = get_worker_info()
    assert info is not None
    assert info.id == worker_id
    np.random.seed(info.seed % (2**32 - 1))


class PrefetchLoader:
    """timm's ``PrefetchLoader`` on the CPU: the next batch taken and prepared one step ahead."""

    def __init__(
        self, loader: DataLoader[Any], mean: float = 0.5, std: float = 2.0, re_prob: float = 0.0
    ) -> None:
        self.loader = loader
        self.mean, self.std, self.re_prob = mean, std, re_prob

    def _erase(self, batch: torch.Tensor) -> torch.Tensor:
        """timm's ``RandomErasing(mode="pixel")``, per sample: ``random`` decides, torch fills."""
        for i in range(batch.shape[0]):
            if random.random() > self.re_prob:
                continue
            width = random.randint(1, batch.shape[1] - 1)
            start = random.randint(1, batch.shape[1] - width)
            batch[i, start : start + width] = torch.empty(width).normal_()
        return batch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        held: tuple[torch.Tensor, torch.Tensor] | None = None  # the batch taken one ahead
        for next_input, next_target in self.loader:
            next_input = next_input.float().sub(self.mean).div(self.std)
            if self.re_prob > 0:
                next_input = self._erase(next_input)
            if held is not None:
                yield held
            held = next_input, next_target
        if held is not None:
            yield held

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset


class RepeatSampler:
    """timm's ``_RepeatSampler``: its sampler's passes, for ever (advancing a ``set_epoch``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.sampler, "sampler", self.sampler)  # a batch sampler's sampler
        epoch = getattr(sampler, "epoch", None) if hasattr(sampler, "set_epoch") else None
        while True:
            if epoch is not None:
                sampler.set_epoch(epoch)
                epoch += 1
            yield from iter(self.sampler)


class MultiEpochsDataLoader(DataLoader[Any]):
    """timm's ``MultiEpochsDataLoader``: one endless iterator, ``len()`` batches per ``iter()``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._DataLoader__initialized = False  # as timm: lets the sampler be replaced
        if self.batch_sampler is None:
            self.sampler = RepeatSampler(self.sampler)
        else:
            self.batch_sampler = RepeatSampler(self.batch_sampler)
        self._DataLoader__initialized = True
        self.iterator: Any = None  # created at the first iter(), as timm

    def __len__(self) -> int:
        if self.batch_sampler is None:
            return len(self.sampler)  # type: ignore[arg-type]
        return len(self.batch_sampler.sampler)  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if self.iterator is None:
            self.iterator = super().__iter__()
        for _ in range(len(self)):
            yield next(self.iterator)


def create_loader(
    dataset: Dataset[Any],
    batch_size: int = 4,
    num_workers: int = 2,
    persistent_workers: bool = True,
    use_multi_epochs_loader: bool = False,
    use_prefetcher: bool = True,
    re_prob: float = 0.0,
) -> Any:
    """What ``timm.data.create_loader(..., is_training=True)`` builds, in the respects above."""
    loader_class = MultiEpochsDataLoader if use_multi_epochs_loader else DataLoader
    loader = loader_class(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        worker_init_fn=worker_init,
        persistent_workers=persistent_workers and num_workers > 0,
        drop_last=True,
    )
    return PrefetchLoader(loader, re_prob=re_prob) if use_prefetcher else loader
