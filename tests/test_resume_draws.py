"""A mid-epoch resume over a source that draws from the global generators (loaded in step).

The user's checkpoint holds the generators as they were where ``state_dict()`` was called:
what the batches after that one draw, uninterrupted. A resumed run (its checkpoint restored
before or after ``load_state_dict``) must give those batches, and its steps, the same numbers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

import nostall

pytestmark = pytest.mark.filterwarnings("ignore::nostall._sources.global_draws.GlobalDrawsWarning")


class Rows(Dataset[torch.Tensor]):
    """Twelve rows, each drawn from Python's random and torch's global generator."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i + random.random()]) + torch.rand(1)


class Stream(IterableDataset[torch.Tensor]):
    """The same rows as a stream."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(12):
            yield torch.tensor([i + random.random()]) + torch.rand(1)


def steps(prefetcher: Any, epochs: range) -> Iterator[list[float]]:
    """Each batch, and what the step after it draws (dropout, say)."""
    for _ in epochs:
        for batch in prefetcher:
            yield [*batch.flatten().tolist(), torch.rand(1).item()]


@pytest.mark.parametrize("restore_first", [True, False], ids=["restored-first", "loaded-first"])
@pytest.mark.parametrize(
    "kind",
    ["sequential", "shuffled", "shuffled-own-generator", "threads", "stream"],
)
def test_a_resumed_run_draws_what_the_uninterrupted_one_drew(
    kind: str, restore_first: bool
) -> None:
    def loader() -> DataLoader[torch.Tensor]:
        if kind == "stream":
            return DataLoader(Stream(), batch_size=3)
        generator = torch.Generator().manual_seed(1) if kind.endswith("generator") else None
        shuffle = kind.startswith("shuffled")
        return DataLoader(Rows(), batch_size=3, shuffle=shuffle, generator=generator)

    threads = 2 if kind == "threads" else None
    torch.manual_seed(0)
    random.seed(0)
    uninterrupted = nostall.prefetch(loader(), threads=threads)
    seen = []
    for step in steps(uninterrupted, range(3)):
        seen.append(step)
        if len(seen) == 6:  # epoch 1, its second batch: the checkpoint
            state, rng, python = (
                uninterrupted.state_dict(),
                torch.get_rng_state(),
                random.getstate(),
            )
    uninterrupted.close()

    torch.manual_seed(99)  # a fresh process
    random.seed(99)
    resumed = nostall.prefetch(loader(), threads=threads)
    if not restore_first:
        resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    random.setstate(python)
    if restore_first:
        resumed.load_state_dict(state)
    rest = list(steps(resumed, range(resumed.epoch, 3)))
    resumed.close()
    assert seen[6:] == rest
