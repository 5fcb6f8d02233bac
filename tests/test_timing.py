"""Timer, timeit and run_concurrently: right under asynchronous execution; Measured figures."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import nostall
from nostall.cuda._timing import Measured


def test_timeit_on_the_cpu() -> None:
    """A 20 ms sleep times as 20 ms, with warm-up calls not timed."""
    calls = []

    def work() -> None:
        calls.append(1)
        time.sleep(0.02)

    timing = nostall.cuda.timeit(work, repeat=5, warmup=2, device="cpu")
    assert 7 == len(calls)
    assert 5 == len(timing.times)
    assert 0.019 < timing.median < 0.05
    assert timing.spread >= 0
    assert str(timing).startswith("median ")


def test_measured_gives_median_range_and_count_of_its_runs() -> None:
    """Median, least, greatest and count, whatever the unit; the runs kept in their order."""
    figure = Measured((3.0, 1.0, 2.0))
    assert (2.0, 1.0, 3.0, 3) == (figure.median, figure.low, figure.high, figure.n)
    assert (3.0, 1.0, 2.0) == figure.runs
    assert 1.0 == figure.spread


def test_measured_formats_as_a_table_cell_and_describes_with_its_unit() -> None:
    """f"{x:.2f}" is the median then the range; describe() adds the unit and the count."""
    assert "1.25 (1.10-1.40)" == f"{Measured((1.1, 1.25, 1.4)):.2f}"
    rate = Measured((1000.0, 1200.0, 1100.0))
    assert "1,100 samples/s (1,000-1,200 over 3 runs)" == rate.describe(",.0f", "samples/s")
    assert "1,000 samples/s (one run)" == Measured((1000.0,)).describe(",.0f", "samples/s")


def test_measured_says_which_side_of_one_a_ratio_lies() -> None:
    """Only a range wholly above (or below) 1 is a gain (or a cost)."""
    assert Measured((1.1, 1.2, 1.4)).exceeds_one
    assert Measured((0.7, 0.8, 0.9)).below_one
    straddling = Measured((0.95, 1.05, 1.2))
    assert not straddling.exceeds_one
    assert not straddling.below_one


def test_measured_refuses_no_runs() -> None:
    """A figure nobody measured is None, not an empty Measured."""
    with pytest.raises(ValueError, match=r"at least one run \(got \(\)\)"):
        Measured(())


def test_measured_refuses_runs_that_are_not_a_tuple() -> None:
    """A list would make a frozen, hashable value mutable: the error says what to pass."""
    with pytest.raises(TypeError, match=r"got list\): pass tuple\(values\)"):
        Measured([1.0, 2.0])  # type: ignore[arg-type]


def test_timing_is_the_measured_type_under_its_public_name() -> None:
    """nostall.cuda.Timing, which timeit returns, is Measured; .times reads its runs."""
    assert nostall.cuda.Timing is nostall.cuda.Measured
    timing = nostall.cuda.timeit(lambda: None, repeat=3, warmup=0, device="cpu")
    assert isinstance(timing, nostall.cuda.Timing)
    assert timing.runs == timing.times


def test_timer_context_on_the_cpu() -> None:
    """The block's wall time."""
    with nostall.cuda.Timer("cpu") as t:
        time.sleep(0.01)
    assert 0.009 < t.seconds < 0.1


def test_timeit_rejects_bad_counts() -> None:
    """repeat >= 1, warmup >= 0."""
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        nostall.cuda.timeit(lambda: None, repeat=0)


def test_run_concurrently_on_the_cpu_runs_in_order() -> None:
    """Without CUDA the callables run one after the other; results in order."""
    order: list[int] = []

    def first() -> str:
        order.append(1)
        return "a"

    def second() -> str:
        order.append(2)
        return "b"

    results = nostall.cuda.run_concurrently(first, second, device="cpu")
    assert ["a", "b"] == results
    assert [1, 2] == order


@pytest.mark.cuda
def test_cuda_unsynchronised_wall_clock_is_wrong_and_timeit_is_right() -> None:
    """Seed 003's lesson: wall-clock around queued GPU work measures the queueing."""
    a = torch.randn(4096, 4096, device="cuda")

    def work() -> None:
        for _ in range(20):
            a @ a

    work()
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()  # returns once queued
    naive = time.perf_counter() - start
    torch.cuda.synchronize()
    true = nostall.cuda.timeit(work, repeat=3, device="cuda").median
    assert naive < 0.5 * true, (naive, true)
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    assert abs(true - (time.perf_counter() - start)) < 0.3 * true


@pytest.mark.cuda
def test_cuda_run_concurrently_prevents_the_seed_004_race() -> None:
    """A sum on a new stream racing normal_() on the default stream: wrong; the helper: right.

    The default stream is kept busy, then a big tensor is filled by normal_() there; reading
    it on a fresh stream without a wait sees it unfinished.
    """
    n = 1 << 26

    def fill(x: torch.Tensor) -> None:
        torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]  # keep the default stream busy
        x.fill_(1.0)

    # Every allocation is made before the race: a cudaMalloc (a stream's first allocation of
    # a size) may synchronise the whole device and so hide the race (seen on an H100: the
    # test passed the wrong example when x and the side stream's sum output were new blocks).
    x = torch.zeros(n, device="cuda")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):
        x.sum()  # the side stream's pool now holds what a sum allocates
    torch.cuda.synchronize()

    # The seed's documented wrong example: no wait before using x on a new stream.
    fill(x)
    with torch.cuda.stream(side):
        wrong = x.sum()
    torch.cuda.synchronize()
    assert float(wrong) != float(n)  # it read x before fill_ finished

    x.zero_()
    fill(x)
    (right,) = nostall.cuda.run_concurrently(lambda: x.sum())
    assert float(right) == float(n)


def test_timer_on_another_accelerator_synchronises_around_the_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On MPS or XPU the ops are asynchronous: the timing waits for the device at both ends."""
    from nostall.cuda import _timing

    events: list[str] = []
    monkeypatch.setattr(
        torch.accelerator, "synchronize", lambda device=None: events.append(f"sync {device}")
    )
    monkeypatch.setattr(_timing, "resolve_device", lambda device: torch.device("mps"))
    with nostall.cuda.Timer("mps") as t:
        events.append("work")
    assert ["sync mps", "work", "sync mps"] == events
    assert t.seconds >= 0.0


def test_timeit_flushes_l2_before_each_run_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each timed run starts with a cold L2 (flush_l2=True, the default); False keeps it warm."""
    from nostall.cuda import _timing

    order: list[str] = []

    def flusher(device: torch.device) -> Any:
        return lambda: order.append("flush")

    monkeypatch.setattr(_timing, "_l2_flusher", flusher)
    _timing.timeit(lambda: order.append("run"), repeat=3, warmup=1, device="cpu")
    assert ["run", "flush", "run", "flush", "run", "flush", "run"] == order
    order.clear()
    _timing.timeit(lambda: order.append("run"), repeat=2, warmup=0, device="cpu", flush_l2=False)
    assert ["run", "run"] == order


def test_the_l2_flusher_writes_twice_the_l2_of_the_device() -> None:
    """Twice the L2 size the device reports (128 MiB if it says none), on the device."""
    from simcuda import simulated_cuda

    from nostall.cuda import _timing

    assert _timing._l2_flusher(torch.device("cpu")) is None
    with simulated_cuda():
        flush = _timing._l2_flusher(torch.device("cuda", 0))
        assert flush is not None
        buffer = flush.__self__  # type: ignore[attr-defined]
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0)
        assert buffer.is_cuda
        assert (2 * l2 if l2 else 128 * 2**20) == buffer.numel() * buffer.element_size()
