"""depth="auto" and the one memory-budget rule (``nostall._engine.autodepth``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers import SleepingSource

import nostall
from nostall._engine import autodepth as _autodepth


def slow_source(n: int) -> Iterator[torch.Tensor]:
    """``n`` batches of 1 KiB, 3 ms apart, as a one-shot generator (no ``len``)."""
    return iter(SleepingSource(n, 0.003, (256,), torch.float32))


def test_the_budget_is_a_share_of_available_memory_and_a_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches of 1 MiB with 100 MiB available: 10 fit in the 10% share; tiny ones hit the cap."""
    monkeypatch.setattr(_autodepth, "available_memory", lambda device: 100 << 20)
    cpu = torch.device("cpu")
    assert _autodepth.depth_budget(1 << 20, cpu) == 10
    assert _autodepth.depth_budget(1, cpu) == _autodepth.MAX_DEPTH
    assert _autodepth.depth_budget(1 << 30, cpu) == 1  # never below one batch
    assert _autodepth.depth_budget(0, cpu) == _autodepth.MAX_DEPTH  # nothing to weigh


def test_batch_nbytes_counts_every_tensor() -> None:
    batch = {"x": torch.zeros(4, 8), "y": [torch.zeros(3, dtype=torch.int64)], "name": "a"}
    assert _autodepth.batch_nbytes(batch) == 4 * 8 * 4 + 3 * 8


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
    monkeypatch.setattr(_autodepth, "MEMORY_SHARE", 1e-12)
    it = iter(nostall.prefetch(slow_source(20), "cpu", depth="auto", timeout=5))
    assert list(range(20)) == [int(b[0]) for b in it]
    assert 1 == it.depth


def test_auto_depth_never_exceeds_its_cap() -> None:
    """However dry the queue runs, at most MAX_DEPTH batches are fetched ahead."""
    it = iter(nostall.prefetch(slow_source(300), "cpu", depth="auto", timeout=5))
    for _ in it:
        pass
    assert it.depth <= _autodepth.MAX_DEPTH
