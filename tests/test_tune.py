"""depth="auto", nostall.tune, and the loader factories they take."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._tune import Setting, accepted_knobs, measure


class Sleepy(Dataset[torch.Tensor]):
    """Each sample waits ``delay`` seconds (I/O-like), so parallel loading pays."""

    def __init__(self, n: int = 20_000, delay: float = 0.001) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((16,), float(i))


def factory(
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader[torch.Tensor]:
    return DataLoader(
        Sleepy(),
        batch_size=8,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


def slow_source(n: int) -> Iterator[torch.Tensor]:
    for i in range(n):
        time.sleep(0.003)
        yield torch.full((256,), float(i))


# -- depth="auto" --------------------------------------------------------------------------------


def test_auto_depth_grows_when_the_queue_runs_dry() -> None:
    """A consumer that always finds nothing ready doubles the depth; the stream is unchanged."""
    it = iter(nostall.prefetch(slow_source(30), "cpu", depth="auto", timeout=5))
    out = [int(batch[0]) for batch in it]
    assert list(range(30)) == out
    assert it.depth > 1


def test_auto_depth_starts_at_one() -> None:
    """Before any batch, the auto depth is 1."""
    it = iter(nostall.prefetch([torch.zeros(1)], "cpu", depth="auto"))
    assert 1 == it.depth
    assert [0.0] == [float(b) for b in it]


def test_auto_depth_is_bounded_by_the_memory_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a budget too small for two batches, the depth stays at 1."""
    import nostall._prefetcher as module

    monkeypatch.setattr(module, "AUTO_MEMORY_SHARE", 1e-12)
    it = iter(nostall.prefetch(slow_source(20), "cpu", depth="auto", timeout=5))
    assert list(range(20)) == [int(b[0]) for b in it]
    assert 1 == it.depth


def test_auto_depth_never_exceeds_its_cap() -> None:
    """However dry the queue runs, at most AUTO_MAX_DEPTH batches are fetched ahead."""
    from nostall._prefetcher import AUTO_MAX_DEPTH

    it = iter(nostall.prefetch(slow_source(300), "cpu", depth="auto", timeout=5))
    for _ in it:
        pass
    assert it.depth <= AUTO_MAX_DEPTH


# -- factories -----------------------------------------------------------------------------------


def test_accepted_knobs() -> None:
    """Only the settings a factory names (or all, with **kwargs) are passed."""

    def named(num_workers: int = 0) -> list[int]:
        return []

    def anything(**kwargs: Any) -> list[int]:
        return []

    assert {"num_workers"} == accepted_knobs(named)
    assert {"num_workers", "pin_memory", "prefetch_factor", "persistent_workers"} == (
        accepted_knobs(anything)
    )
    assert set() == accepted_knobs(lambda: [])


def test_measure_skips_start_up_and_counts_samples() -> None:
    """A trial times the batches after the warm-up, in samples/s, and says what it used."""
    rate, used = measure(factory, Setting(0, 2), torch.device("cpu"), batches=5)
    assert 7 == used
    assert 8 / 0.008 * 0.5 < rate < 8 / 0.008 * 1.5  # one sample per ms, give or take


# -- tune ----------------------------------------------------------------------------------------


def test_tune_finds_parallel_loading_within_budget() -> None:
    """Against a grid of every setting, tune gets close to the best, spending few batches."""
    cpu = torch.device("cpu")
    grid = {
        s: measure(factory, s, cpu, batches=12)[0]
        for s in (Setting(w, d) for w in (0, 2) for d in (2, 4, 8))
    }
    best_grid = max(grid.values())
    result = nostall.tune(factory, budget=300, device="cpu", max_workers=2)
    long_epoch = len(factory())  # 2,500 batches
    assert result.batches_spent <= 0.03 * long_epoch * 4  # 300: 3% of a 10,000-batch epoch
    assert result.batches_spent <= 300
    assert result.samples_per_s >= 0.8 * best_grid, (result, grid)  # 95% in quiet conditions
    assert 2 == result.best.num_workers
    assert result.curve[0][0] == Setting(0, 2)


def test_tune_without_a_num_workers_knob_tunes_depth_only() -> None:
    """A factory that takes no settings still gets a depth."""
    result = nostall.tune(lambda: DataLoader(Sleepy(400), batch_size=8), budget=60, device="cpu")
    assert result.best.num_workers is None
    assert result.best.depth is not None
