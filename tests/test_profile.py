"""The stall profiler: accuracy, arithmetic, verdicts, and all-rank reports."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import CountingSource, SleepingSource, assert_same_batches, run_torchrun

import nostall
from nostall import NostallError, StallReport


def test_batches_are_unchanged() -> None:
    """The wrapper yields the same batches, in order, every epoch."""
    source = [torch.tensor([i, i]) for i in range(9)]
    wrapped = nostall.profile(source, device="cpu")
    for _ in range(2):
        assert_same_batches(source, wrapped)
    assert 18 == wrapped.report().batches


def test_wait_counts_an_injected_stall() -> None:
    """A source that takes 20 ms per batch, consumed without prefetching: waits of 20 ms or more.

    Only lower bounds here (a sleep never ends early); how close the figures come to the
    truth is a timing claim, tested by ``make test-perf``.
    """
    wrapped = nostall.profile(iter(SleepingSource(15, 0.02, (4, 2), torch.float32)), device="cpu")
    for _ in wrapped:
        time.sleep(0.005)
    report = wrapped.report()
    assert report.wait_s >= 15 * 0.02, report
    assert report.wait_p50_s >= 0.02
    assert report.interval_p50_s >= 0.025  # the wait and the 5 ms step
    assert 60 == report.samples
    assert report.iterations == 1


@pytest.mark.perf
def test_wait_matches_an_injected_stall() -> None:
    """The same, within 5% of the injected 300 ms (a timing claim: ``make test-perf``)."""
    wrapped = nostall.profile(iter(SleepingSource(15, 0.02, (4, 2), torch.float32)), device="cpu")
    for _ in wrapped:
        time.sleep(0.005)
    report = wrapped.report()
    expected = 15 * 0.02
    assert abs(report.wait_s - expected) <= max(0.05 * expected, 15 * 0.003), report
    assert 0.02 <= report.wait_p50_s < 0.03
    assert 0.025 <= report.interval_p50_s < 0.04
    assert "highly input-bound" == report.verdict


def test_prefetching_with_profile_reports_every_batch_and_the_start_up() -> None:
    """Loading 10 ms, step 25 ms, through prefetch(profile=True): the report's structure."""
    p = nostall.prefetch(iter(SleepingSource(12, 0.01, (4, 2), torch.float32)), "cpu", profile=True)
    for _ in p:
        time.sleep(0.025)
    report = p.report()
    assert 12 == report.batches
    assert report.iterations == 1
    assert report.startup_wait_s >= 0.01  # the first batch's load is waited for, and seen
    assert report.loop_s >= 12 * 0.025


@pytest.mark.perf
def test_prefetching_hides_the_stall_and_the_report_shows_it() -> None:
    """Almost no waiting after the first batch (a timing claim: ``make test-perf``)."""
    p = nostall.prefetch(iter(SleepingSource(12, 0.01, (4, 2), torch.float32)), "cpu", profile=True)
    for _ in p:
        time.sleep(0.025)
    report = p.report()
    assert report.stall_fraction < 0.15, report  # the first batch's load is the only wait
    assert report.steady_stall_fraction < 0.05, report


def test_report_needs_profile_true() -> None:
    """A clear error, not an empty report."""
    with pytest.raises(NostallError, match="pass profile=True"):
        nostall.prefetch([1]).report()


def test_zero_batches_give_a_report_of_zeros() -> None:
    """An empty source is not an error."""
    nothing: list[torch.Tensor] = []
    wrapped = nostall.profile(nothing, device="cpu")
    assert [] == list(wrapped)
    report = wrapped.report()
    assert (0, 0.0, 0.0, None) == (
        report.batches,
        report.wait_s,
        report.stall_fraction,
        report.samples,
    )
    assert "not input-bound" == report.verdict


@pytest.mark.parametrize(
    ("wait", "verdict"),
    [
        (0.0, "not input-bound"),
        (0.049, "not input-bound"),
        (0.05, "moderately input-bound"),
        (0.199, "moderately input-bound"),
        (0.2, "highly input-bound"),
    ],
)
def test_verdict_thresholds(wait: float, verdict: str) -> None:
    """TensorFlow's thresholds: under 5%, 5 to 20%, 20% and more."""
    report = StallReport(batches=10, wait_s=wait, loop_s=1.0)
    assert verdict == report.verdict
    assert wait == report.stall_fraction


@pytest.mark.parametrize(
    ("wait", "step"),
    [(0.01, "time the step itself"), (0.1, "worth a try: more workers"), (0.5, "load faster")],
)
def test_every_verdict_names_a_next_step(wait: float, step: str) -> None:
    report = StallReport(batches=10, wait_s=wait, loop_s=1.0)
    assert step in report.next_step
    lines = [line.split() for line in str(report).splitlines()]
    assert ["next", "step", *report.next_step.split()] in lines
    assert report.next_step == report.to_dict()["next_step"]


def test_arithmetic_and_dict() -> None:
    """stall_fraction and samples/s from the totals; to_dict carries the derived figures."""
    report = StallReport(batches=4, wait_s=0.5, loop_s=2.0, samples=400)
    assert 0.25 == report.stall_fraction
    assert 200.0 == report.samples_per_s
    figures = report.to_dict()
    assert "highly input-bound" == figures["verdict"]
    assert 0.25 == figures["stall_fraction"]
    assert "waiting for data" in str(report)


def test_errors_pass_through_and_close_the_loop() -> None:
    """An error in the source reaches the caller; the time up to it is counted."""

    def failing() -> Iterator[torch.Tensor]:
        yield torch.zeros(1)
        time.sleep(0.02)
        raise ValueError("broken record")

    wrapped = nostall.profile(failing(), device="cpu")
    with pytest.raises(ValueError, match="broken record"):
        list(wrapped)
    report = wrapped.report()
    assert 1 == report.batches
    assert report.loop_s >= 0.02


def test_time_between_epochs_is_not_loop_time() -> None:
    """A pause between two epochs (validation, say) does not count."""
    wrapped = nostall.profile([torch.zeros(1)] * 3, device="cpu")
    list(wrapped)
    pause = 0.5
    time.sleep(pause)  # the validation between two epochs
    list(wrapped)
    assert wrapped.report().loop_s < pause  # six instant batches, whatever the machine's load


def test_overhead_per_batch_is_small() -> None:
    """On an instant source the wrapper adds microseconds per batch (1% of a 2 ms step)."""
    items = [torch.zeros(1)] * 20_000
    start = time.perf_counter()
    for _ in items:
        pass
    plain = time.perf_counter() - start
    start = time.perf_counter()
    for _ in nostall.profile(items, device="cpu"):
        pass
    wrapped = time.perf_counter() - start
    per_batch = (wrapped - plain) / len(items)
    assert per_batch < 20e-6, f"{per_batch * 1e6:.1f} us per batch"


def test_profiling_does_not_change_the_prefetched_stream() -> None:
    """prefetch(profile=True) yields what prefetch() yields."""
    source = CountingSource(30)
    assert list(range(30)) == [int(t) for t in nostall.prefetch(source, profile=True)]


def test_all_ranks_without_distributed_is_this_rank() -> None:
    """Outside torch.distributed, all_ranks reports this process as rank 0."""
    wrapped = nostall.profile([torch.zeros(2)], device="cpu")
    list(wrapped)
    report = wrapped.report(all_ranks=True)
    assert 0 == report.slowest_rank
    assert [0] == [r["rank"] for r in report.ranks]


def test_torchrun_names_the_rank_with_the_slow_loader(tmp_path: Path) -> None:
    """Two ranks under torchrun (gloo, CPU): the report names rank 1, given the slow loader."""
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent("""
        import time
        import torch
        import torch.distributed as dist
        import nostall

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        delay = 0.03 if rank == 1 else 0.0

        def source():
            for i in range(10):
                time.sleep(delay)
                yield torch.zeros(8, 2)

        wrapped = nostall.profile(source(), device="cpu")
        for batch in wrapped:
            time.sleep(0.005)
        report = wrapped.report(all_ranks=True)
        if rank == 0:
            print(report)
            print("slowest rank:", report.slowest_rank)
        dist.destroy_process_group()
    """)
    )
    done = run_torchrun(script, timeout=180)
    assert 0 == done.returncode, done.stderr[-3000:]
    assert "slowest rank: 1" in done.stdout
    assert "rank 1" in done.stdout


class _FakeEvent:
    """Stands in for a CUDA timing event: completes when the fake GPU's clock passes it.

    The fake GPU runs ten events behind the host, as a real one runs behind queued work.
    """

    gpu_done_ms = 0.0  # how far the fake GPU has got
    clock_ms = 0.0

    def __init__(self) -> None:
        _FakeEvent.clock_ms += 1.5
        _FakeEvent.gpu_done_ms = max(_FakeEvent.gpu_done_ms, _FakeEvent.clock_ms - 15.0)
        self.at_ms = _FakeEvent.clock_ms

    def query(self) -> bool:
        return self.at_ms <= _FakeEvent.gpu_done_ms

    def synchronize(self) -> None:
        _FakeEvent.gpu_done_ms = max(_FakeEvent.gpu_done_ms, self.at_ms)

    def elapsed_time(self, other: _FakeEvent) -> float:
        assert self.query()
        assert other.query()
        return other.at_ms - self.at_ms


def test_cuda_idle_events_are_folded_and_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run holds at most FOLD_EVERY pending pairs; the idle sum counts every pair."""
    from nostall._engine import profile as _profile

    monkeypatch.setattr(_profile, "_event", lambda device: _FakeEvent())
    monkeypatch.setattr(_FakeEvent, "clock_ms", 0.0)
    monkeypatch.setattr(_FakeEvent, "gpu_done_ms", 0.0)
    recorder = _profile.StallRecorder(torch.device("cuda"))
    most = 0
    for _ in range(500):
        recorder.before_next()
        recorder.after_next(torch.zeros(2))
        most = max(most, len(recorder._events))
    assert most <= recorder.FOLD_EVERY
    assert len(recorder._events) < 500
    report = recorder.report()
    assert report.gpu_idle_s == pytest.approx(500 * 1.5e-3)  # each pair is 1.5 ms apart
    assert not recorder._events  # report waited for the last pair and folded all


def test_the_first_batch_of_each_epoch_is_reported_apart_from_the_steady_waits() -> None:
    """Worker start-up, paid once per epoch, is shown apart; the verdict is the steady state's."""

    class SlowStart:
        def __len__(self) -> int:
            return 6

        def __iter__(self) -> Iterator[torch.Tensor]:
            time.sleep(0.5)  # start-up: the first batch of each epoch waits for it
            yield from (torch.ones(2) for _ in range(6))

    profiled = nostall.profile(SlowStart(), "cpu")
    for _ in range(2):
        for _ in profiled:
            time.sleep(0.01)  # the step; the next batch is ready at once
    report = profiled.report()
    assert (report.batches, report.iterations) == (12, 2)
    assert report.startup_wait_s >= 1.0  # the two start-ups
    assert report.wait_s >= report.startup_wait_s
    assert report.wait_max_s < 0.5  # percentiles are the steady waits'
    assert report.stall_fraction > report.steady_stall_fraction
    assert report.verdict == _verdict_of(report.steady_stall_fraction)
    text = str(report)
    assert "for each epoch's first batch" in text
    assert "over 2 iterations (the loader's start, once an epoch)" in text
    assert "after it (steady state)" in text
    assert report.to_dict()["steady_stall_fraction"] == report.steady_stall_fraction


def _verdict_of(fraction: float) -> str:
    if fraction < 0.05:
        return "not input-bound"
    return "moderately input-bound" if fraction < 0.20 else "highly input-bound"
