"""The prefetcher on the CPU: equivalence, errors, lifecycle, bad input."""

from __future__ import annotations

import gc
import inspect
import os
import re
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    Blocking,
    BrokenIter,
    CountingSource,
    MultiArgError,
    RaisingSource,
    SqliteRows,
    Unmovable,
    as_dataset,
    assert_same_batches,
    nostall_threads,
    settle,
    wait_for_no_nostall_threads,
    wait_until,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import nostall
from nostall import (
    DeviceUnavailableError,
    Prefetcher,
    PrefetcherClosedError,
    PrefetchTimeoutError,
    ProducerDiedError,
)


class Squares(Dataset[dict[str, Any]]):
    """A map-style dataset with nested samples."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.tensor([i, i * i]), "y": i % 3, "name": f"s{i}"}


def make_loader(batch_size: int | None, workers: int, **kwargs: Any) -> DataLoader[Any]:
    return DataLoader(Squares(), batch_size=batch_size, num_workers=workers, **kwargs)


# -- row 1, 2: equivalence over epochs; partial last batch --------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("batch_size", [1, 7, None])
def test_same_batches_as_the_loader_over_three_epochs(batch_size: int | None, workers: int) -> None:
    """Same values, order and count as the plain loader, epoch after epoch."""
    loader = make_loader(batch_size, workers)
    p = nostall.prefetch(loader, "cpu")
    for _ in range(3):
        assert_same_batches(loader, p)


def test_partial_last_batch_is_delivered() -> None:
    """23 samples in batches of 7: the last batch of 2 arrives."""
    batches = list(nostall.prefetch(make_loader(7, 0)))
    assert [len(b["x"]) for b in batches] == [7, 7, 7, 2]


@pytest.mark.parametrize("depth", [1, 2, 5, 64])
def test_every_depth_delivers_every_batch_once_in_order(depth: int) -> None:
    """Depths below, at and above the epoch length all give the exact stream."""
    source = CountingSource(20)
    out = [int(t) for t in nostall.prefetch(source, depth=depth)]
    assert list(range(20)) == out
    assert source.pulled == 20


# -- row 3: empty source ------------------------------------------------------------------------


def test_empty_source_ends_at_once() -> None:
    """A zero-length loader yields nothing, and no thread is left."""
    loader = DataLoader(TensorDataset(torch.empty(0)), batch_size=4)
    start = time.monotonic()
    assert [] == list(nostall.prefetch(loader))
    assert time.monotonic() - start < 10.0  # at once: no wait for a batch that never comes
    assert not wait_for_no_nostall_threads(1.0)


# -- in flight: at most depth -------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 3])
def test_at_most_depth_batches_fetched_ahead(depth: int) -> None:
    """A consumer that stops taking batches lets the producer run ``depth`` ahead, no more."""
    source = CountingSource(50)
    it = iter(nostall.prefetch(source, depth=depth))
    next(it)  # the first two batches are pulled in step, watched for global draws
    next(it)
    wait_until(lambda: source.pulled >= 2 + depth, f"{2 + depth} pulled")
    settle()  # time to overshoot, which it must not
    assert 2 + depth == source.pulled
    next(it)
    wait_until(lambda: source.pulled >= 3 + depth, f"{3 + depth} pulled")
    settle()
    assert 3 + depth == source.pulled
    it.close()


# -- row 4, 5: errors from the source -----------------------------------------------------------


def test_source_error_arrives_after_the_batches_before_it() -> None:
    """Batches 0..k-1 arrive intact, then the same exception object with a note."""
    error = ValueError("bad record at 3")
    seen = []
    with pytest.raises(ValueError, match="bad record at 3") as info:  # noqa: PT012
        for batch in nostall.prefetch(RaisingSource(3, error)):
            seen.append(int(batch))
    assert [0, 1, 2] == seen
    assert info.value is error
    assert any("next(source) for batch 3" in n for n in getattr(info.value, "__notes__", []))


def test_exception_with_several_arguments_is_passed_intact() -> None:
    """An exception class that cannot be rebuilt from a message arrives as the object."""
    error = MultiArgError("shard-7.tar", 12, "truncated")
    with pytest.raises(MultiArgError) as info:
        list(nostall.prefetch(RaisingSource(0, error)))
    assert info.value is error
    assert ("shard-7.tar", 12, "truncated") == (error.path, error.line, error.reason)


def test_traceback_of_the_source_is_kept() -> None:
    """The traceback still shows the frame inside the source that raised."""
    with pytest.raises(ValueError, match="x") as info:
        list(nostall.prefetch(RaisingSource(1, ValueError("x"))))
    frames = [entry.name for entry in info.traceback]
    assert "__iter__" in frames  # RaisingSource.__iter__, where the error happened


def test_after_an_error_a_finished_generator_ends_the_epoch() -> None:
    """A generator that raised is finished: the next next() raises StopIteration."""
    it = iter(nostall.prefetch(RaisingSource(1, KeyError("k"))))
    assert 0 == int(next(it))
    with pytest.raises(KeyError):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.usefixtures("fast_worker_shutdown")
def test_loader_worker_error_is_reraised() -> None:
    """An error in a DataLoader worker reaches the consumer with PyTorch's own message."""

    class Bad(Dataset[int]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> int:
            if i == 5:
                raise IndexError("sample 5 is corrupt")
            return i

    loader = DataLoader(Bad(), batch_size=2, num_workers=2)
    seen = []
    with pytest.raises(IndexError, match="sample 5 is corrupt"):  # noqa: PT012
        for batch in nostall.prefetch(loader):
            seen.append(batch.tolist())
    assert [[0, 1], [2, 3]] == seen


class FlakySamples(Dataset[int]):
    """Samples whose index is in ``bad`` raise; a loop may catch that and go on."""

    def __init__(self, n: int = 12, bad: tuple[int, ...] = (4, 9)) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return i


def skip_bad_batches(batches: Any) -> list[Any]:
    """A loop that logs and skips a batch that raises, as training code often does."""
    seen: list[Any] = []
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return seen
        except ValueError as e:  # from a worker, the message is inside PyTorch's wrapper text
            seen.append(re.findall(r"sample \d+ is corrupt", str(e))[-1])
            continue
        seen.append(batch.tolist())


@pytest.mark.usefixtures("fast_worker_shutdown")
@pytest.mark.parametrize("workers", [0, 2])
def test_error_in_one_batch_does_not_end_the_epoch(workers: int) -> None:
    """After a batch raises, the next next() gives the following batch, as a DataLoader does."""
    loader = DataLoader(FlakySamples(), batch_size=2, num_workers=workers)
    expected = skip_bad_batches(loader)
    assert ["sample 4 is corrupt", [6, 7]] == expected[2:4]  # the premise: the loader goes on
    p = nostall.prefetch(DataLoader(FlakySamples(), batch_size=2, num_workers=workers), "cpu")
    assert expected == skip_bad_batches(p)
    assert expected == skip_bad_batches(p)  # and the next epoch is whole too
    p.close()


def test_a_loop_that_stops_at_an_error_leaves_nothing_running() -> None:
    """While the error (and so the iterator) is still held, no producer runs; asking goes on."""
    it = iter(nostall.prefetch(DataLoader(FlakySamples(), batch_size=2), "cpu", depth=4))
    with pytest.raises(ValueError, match="sample 4") as info:  # noqa: PT012
        while True:
            next(it)
    assert [] == wait_for_no_nostall_threads(timeout=5.0)
    assert info.value is not None
    assert [6, 7] == next(it).tolist()  # a loop that catches it gets the following batches
    with pytest.raises(ValueError, match="sample 9"):
        next(it)
    assert [[10, 11]] == [b.tolist() for b in it]


def test_a_state_saved_after_a_failed_batch_resumes_after_it() -> None:
    """The failed batch counts as handed out: resuming skips it, as the plain loop went on."""
    loader = DataLoader(FlakySamples(), batch_size=2)
    p = nostall.prefetch(loader, "cpu")
    it = iter(p)
    assert [0, 1] == next(it).tolist()
    assert [2, 3] == next(it).tolist()
    with pytest.raises(ValueError, match="sample 4"):
        next(it)
    state = p.state_dict()
    assert 3 == state["batches_yielded"]
    p.close()
    resumed = nostall.prefetch(DataLoader(FlakySamples(), batch_size=2), "cpu")
    resumed.load_state_dict(state)
    assert [[6, 7], "sample 9 is corrupt", [10, 11]] == skip_bad_batches(resumed)
    resumed.close()


class NoNotes(Exception):
    """An exception that refuses notes: attribute writes fail."""

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("read-only exception")

    def add_note(self, note: str) -> None:
        raise TypeError("no notes here")


class BadNotes(Exception):
    """An exception whose ``__notes__`` is not a list."""

    def __init__(self) -> None:
        super().__init__("bad notes")
        self.__notes__ = ("a tuple",)


@pytest.mark.parametrize("error", [NoNotes("refuses notes"), BadNotes()])
def test_user_exception_arrives_itself_even_when_it_refuses_notes(error: Exception) -> None:
    """An exception that cannot take a note still reaches the user, never ProducerDiedError."""
    with pytest.raises(type(error)) as info:
        list(nostall.prefetch(RaisingSource(2, error), "cpu"))
    assert info.value is error


@pytest.mark.parametrize("threads", [None, 2])
def test_a_dataset_bound_to_its_thread_is_told_the_fix(threads: int | None) -> None:
    """sqlite3's own error, with a note: nostall's thread met it, and what to do instead."""
    import sqlite3

    # timeout= makes the producer pull every batch (no hand-off in this thread): the first
    # batch already meets the connection in another thread.
    p = nostall.prefetch(DataLoader(SqliteRows(), batch_size=4), "cpu", threads=threads, timeout=60)
    with pytest.raises(sqlite3.ProgrammingError, match="same thread") as info:
        list(p)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "used outside the thread that made it" in notes
    for fix in ("threading.local()", "check_same_thread=False", "num_workers=N"):
        assert fix in notes
    p.close()


# -- row 6: errors before the first batch -------------------------------------------------------


def test_iter_error_surfaces_on_first_next_not_on_iter() -> None:
    """``iter(source)`` raising surfaces on the first next(), with a note."""
    it = iter(nostall.prefetch(BrokenIter()))
    with pytest.raises(OSError, match="cannot open the shards") as info:
        next(it)
    assert any("iter(source)" in n for n in getattr(info.value, "__notes__", []))
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.usefixtures("fast_worker_shutdown")
def test_worker_init_error_surfaces_on_first_next() -> None:
    """A failing ``worker_init_fn`` surfaces on the first next()."""

    def init(worker_id: int) -> None:
        raise RuntimeError(f"worker {worker_id} cannot start")

    loader = DataLoader(as_dataset(range(10)), batch_size=2, num_workers=2, worker_init_fn=init)
    it = iter(nostall.prefetch(loader))
    with pytest.raises(RuntimeError, match="cannot start"):
        next(it)


# -- row 7: transfer errors ---------------------------------------------------------------------


def test_transfer_error_is_reraised_from_the_transfer_step() -> None:
    """An object whose ``.to()`` raises: the error arrives, noted as a transfer error."""
    source: list[Any] = [torch.tensor([0]), Unmovable()]
    it = iter(nostall.prefetch(source, "cpu"))
    assert 0 == int(next(it))
    with pytest.raises(RuntimeError, match="Unmovable cannot go to cpu") as info:
        next(it)
    assert any("while moving batch 1 to cpu" in n for n in getattr(info.value, "__notes__", []))


# -- row 8, 9: break, del, garbage collection ---------------------------------------------------


def test_break_stops_the_thread_within_a_second() -> None:
    """Leaving the loop early stops the producer promptly."""
    for _ in nostall.prefetch(CountingSource(1000)):
        break
    assert not wait_for_no_nostall_threads(1.0)


def test_del_iterator_stops_the_thread() -> None:
    """Dropping a half-used iteration stops its producer."""
    p = nostall.prefetch(CountingSource(1000))
    it = iter(p)
    next(it)
    assert nostall_threads()
    del it
    assert not wait_for_no_nostall_threads(1.0)


def test_dropped_prefetcher_is_collected() -> None:
    """No reference cycle through the thread keeps a dropped prefetcher alive."""
    p = nostall.prefetch(CountingSource(1000))
    it = iter(p)
    next(it)
    ref_p, ref_it = weakref.ref(p), weakref.ref(it)
    del p, it
    assert ref_p() is None  # freed by reference counting alone, no cycle
    assert ref_it() is None
    gc.collect()
    assert not wait_for_no_nostall_threads(1.0)


def test_prefetcher_dropped_while_its_iteration_runs_keeps_going() -> None:
    """``for b in prefetch(loader)`` holds only the iteration; it must not be stopped."""
    out = []
    for batch in nostall.prefetch(CountingSource(8)):
        gc.collect()
        out.append(int(batch))
    assert list(range(8)) == out


# -- row 10: lifecycle ---------------------------------------------------------------------------


def test_close_is_idempotent_and_stops_the_thread() -> None:
    """close() twice is fine, and nothing runs afterwards."""
    p = nostall.prefetch(CountingSource(1000))
    it = iter(p)
    next(it)
    p.close()
    p.close()
    assert p.closed
    assert not nostall_threads()


def test_iterating_a_closed_prefetcher_raises() -> None:
    """A clear error, not an empty epoch."""
    p = nostall.prefetch(CountingSource(3))
    p.close()
    with pytest.raises(PrefetcherClosedError, match="was closed"):
        iter(p)


def test_iteration_of_a_closed_prefetcher_raises() -> None:
    """An iteration cut short by close() says so on its next next()."""
    p = nostall.prefetch(CountingSource(1000))
    it = iter(p)
    next(it)
    p.close()
    with pytest.raises(PrefetcherClosedError, match="Prefetcher was closed"):
        next(it)


def _iterate_in_threads(p: Any, loops: int, also: Callable[[], None] = lambda: None) -> list[str]:
    """Run ``loops`` full loops over ``p`` in threads at once, then ``also()``; their errors."""
    errors: list[str] = []
    started = threading.Barrier(loops + 1)

    def loop() -> None:
        started.wait(60)
        try:
            for _ in p:
                pass
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=loop) for _ in range(loops)]
    for thread in threads:
        thread.start()
    started.wait(60)
    also()
    for thread in threads:
        thread.join(60)
    p.close()
    return errors


# One thread's iter(loader) draws the DataLoader's base seed from torch's generator while the
# other's first pull is watched for draws: that thread's source reads as drawing.
@pytest.mark.filterwarnings("ignore::nostall._sources.global_draws.GlobalDrawsWarning")
def test_two_threads_iterating_one_prefetcher_are_told_what_happened() -> None:
    """iter() in two threads at once: the loser hears of the newer iteration, never "a bug"."""
    errors = []
    for _ in range(30):
        errors += _iterate_in_threads(
            nostall.prefetch(DataLoader(as_dataset(range(400)), batch_size=4)), 2
        )
    assert errors, "no run overlapped"
    for error in errors:
        assert error.startswith("PrefetcherClosedError"), error
        assert "a newer iter()" in error, error


def test_close_from_another_thread_is_reported_as_a_close() -> None:
    """close() while another thread iterates: that thread hears of the close, never "a bug"."""
    errors = []
    for _ in range(30):
        p = nostall.prefetch(DataLoader(as_dataset(range(4000)), batch_size=4))
        errors += _iterate_in_threads(p, 1, also=p.close)
    for error in errors:
        assert error.startswith("PrefetcherClosedError"), error
        assert "closed" in error, error


def test_context_manager_closes() -> None:
    """Leaving the ``with`` block closes the prefetcher."""
    with nostall.prefetch(CountingSource(1000)) as p:
        next(iter(p))
    assert p.closed
    assert not nostall_threads()


# -- row 11: a second iter() --------------------------------------------------------------------


def test_second_iter_stops_the_first() -> None:
    """Two threads never pull from one source; the old iteration says it was replaced."""
    source = CountingSource(100, delay=0.001)
    p = nostall.prefetch(source)
    first = iter(p)
    next(first)
    second = iter(p)
    assert list(range(100)) == [int(t) for t in second]
    with pytest.raises(PrefetcherClosedError, match="newer iter"):
        next(first)
    assert 2 == source.iters


def test_two_iterations_at_once_are_refused_with_the_fix_that_fits() -> None:
    """``zip(p, p)``: the second iter() stops the first, whose next() names a second prefetcher."""
    p = nostall.prefetch([torch.tensor([i]) for i in range(4)])
    with pytest.raises(PrefetcherClosedError, match="newer iter") as raised:
        list(zip(p, p, strict=False))
    assert "nostall.prefetch(another_loader)" in str(raised.value)
    assert "start a new one with iter(prefetcher)" not in str(raised.value)
    assert [0, 1, 2, 3] == [int(t) for t in p]  # and the prefetcher goes on


def test_new_iteration_waits_for_the_previous_producer() -> None:
    """The producer of a replaced iteration is inside a slow next(); the new one waits for it."""
    in_next = threading.Event()
    active = []

    class Slow:
        def __iter__(self) -> Iterator[int]:
            for i in range(3):
                active.append(1)
                if len(active) > 1:
                    raise AssertionError("two producers pulled at once")
                in_next.set()
                time.sleep(0.2)
                active.pop()
                yield i

    p = nostall.prefetch(Slow(), depth=1)
    first = iter(p)
    assert 0 == next(first)
    in_next.wait(1)
    assert [0, 1, 2] == list(p)


def test_iter_alone_takes_nothing_from_the_source() -> None:
    """iter() without next() neither creates the source's iterator nor draws random numbers."""
    generator = torch.Generator().manual_seed(1)
    loader = DataLoader(as_dataset(range(10)), batch_size=3, shuffle=True, generator=generator)
    state = generator.get_state()
    p = nostall.prefetch(loader)
    iter(p)  # as Lightning does to check that an object is iterable
    iter(p)
    assert torch.equal(state, generator.get_state())
    assert not nostall_threads()
    expected = list(
        DataLoader(
            as_dataset(range(10)),
            batch_size=3,
            shuffle=True,
            generator=torch.Generator().manual_seed(1),
        )
    )
    assert_same_batches(expected, p)


# -- row 14: stalls, timeouts, a dead producer --------------------------------------------------


def test_timeout_names_the_wait_and_loses_nothing() -> None:
    """A stalled source with timeout= raises a TimeoutError; the batch still arrives later."""
    source = CountingSource(2, delay=0.6)
    it = iter(nostall.prefetch(source, timeout=0.2))
    with pytest.raises(PrefetchTimeoutError, match=r"timeout=0.2 s: batch 0") as info:
        next(it)
    assert isinstance(info.value, TimeoutError)
    assert "next(source) for batch 0" in str(info.value)
    puller = it._puller
    assert puller is not None  # the first next() started it
    wait_until(lambda: not puller.channel.empty(), "the stalled batch queued")
    assert 0 == int(next(it))  # nothing lost
    it.close()


BLOCKING_BATCHES = [[i, i + 1] for i in range(0, 16, 2)]


@pytest.mark.parametrize("threads", [None, 2])
def test_timeout_names_the_sample_that_has_not_returned(threads: int | None) -> None:
    """The timeout names the stuck sample and the line it waits at."""
    data = Blocking()
    p = nostall.prefetch(DataLoader(data, batch_size=2), timeout=0.5, threads=threads)
    try:
        with pytest.raises(PrefetchTimeoutError) as info:
            list(p)
        assert "dataset[5]" in str(info.value)
        assert "helpers.py" in str(info.value)  # the dataset's own line
        assert "in __getitem__" in str(info.value)
    finally:
        data.release.set()
        p.close()


def test_the_epoch_after_a_timeout_under_threads_starts_anew() -> None:
    """threads=: a sample stuck past timeout= is let go; the next epochs load every batch."""
    data = Blocking()
    p = nostall.prefetch(DataLoader(data, batch_size=2), timeout=0.5, threads=2)
    try:
        with pytest.raises(PrefetchTimeoutError):
            list(p)
        assert BLOCKING_BATCHES == [b.tolist() for b in p]
        assert BLOCKING_BATCHES == [b.tolist() for b in p]
    finally:
        data.release.set()
        p.close()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


class BlockingInAWorker(Dataset[torch.Tensor]):
    """Sample 5 sleeps for an hour the first time any worker process loads it."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5 and not os.path.exists(self.flag):
            open(self.flag, "w").close()
            time.sleep(3600)
        return torch.tensor(i)


@pytest.mark.usefixtures("fast_worker_shutdown")
def test_the_epoch_after_a_timeout_in_a_worker_starts_anew(tmp_path: Path) -> None:
    """A sample stuck in a worker process: the next epoch starts without it, as a DataLoader's."""
    loader = DataLoader(BlockingInAWorker(str(tmp_path / "blocked")), batch_size=2, num_workers=2)
    p = nostall.prefetch(loader, timeout=8)  # generous: worker start-up on a loaded machine
    it = iter(p)
    assert BLOCKING_BATCHES[:2] == [next(it).tolist(), next(it).tolist()]
    with pytest.raises(PrefetchTimeoutError, match=r"batch 2"):
        next(it)
    # The stuck producer, interrupted, ends within the worker queue's poll, else is left.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "nostall: the producer thread", RuntimeWarning)
        epoch = [b.tolist() for b in p]
    assert BLOCKING_BATCHES == epoch
    p.close()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


def test_a_sample_stuck_in_nostalls_thread_keeps_the_next_epoch_waiting() -> None:
    """num_workers=0: the stuck call is the dataset's own; no epoch runs beside it: the fix."""
    data = Blocking()
    p = nostall.prefetch(DataLoader(data, batch_size=2), timeout=0.5)
    try:
        with pytest.raises(PrefetchTimeoutError):
            list(p)
        with pytest.raises(PrefetchTimeoutError, match=r"dataset\[5\].*num_workers=N"):
            list(p)
        data.release.set()  # the call returns: the next epoch goes on
        assert BLOCKING_BATCHES == [b.tolist() for b in p]
    finally:
        data.release.set()
        p.close()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


def test_close_after_a_timeout_does_not_wait_for_the_stuck_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() after a timeout returns without waiting out its join on the stuck producer."""
    import nostall._engine.latest_producer as module

    monkeypatch.setattr(module, "CLOSE_JOIN_S", 120.0)
    data = Blocking()
    p = nostall.prefetch(DataLoader(data, batch_size=2), timeout=0.5)
    try:
        with pytest.raises(PrefetchTimeoutError):
            list(p)
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"dataset\[5\]"):
            p.close()
        assert time.monotonic() - start < 60.0  # not the 120 s join
    finally:
        data.release.set()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


def test_the_loaders_own_timeout_applies_under_threads() -> None:
    """DataLoader(timeout=) under threads=: the DataLoader's error, naming the sample.

    Raised each time the batch is asked for while the sample has not returned; then that batch
    comes, and the rest of the epoch.
    """
    data = Blocking()
    loader = DataLoader(data, batch_size=2, timeout=0.5)
    p = nostall.prefetch(loader, threads=2, timeout=60)  # the loader's comes first
    got: list[Any] = []
    it = iter(p)
    try:
        for _ in range(10):
            try:
                got.append(next(it).tolist())
            except RuntimeError as e:
                got.append(str(e))
                if 2 == sum(isinstance(g, str) for g in got):
                    data.release.set()
    finally:
        data.release.set()
        p.close()
    assert BLOCKING_BATCHES[:2] == got[:2]
    for message in got[2:4]:
        assert message.startswith("DataLoader timed out after 0.5 seconds: dataset[5]"), message
    assert BLOCKING_BATCHES[2:] == got[4:]
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


def test_dead_producer_is_noticed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer that ends without a word raises ProducerDiedError, never hangs."""
    import nostall._engine.iteration as module

    # It ends as produce() ends, whatever happened in it: ``producing`` cleared last.
    monkeypatch.setattr(module, "produce", lambda puller: puller.channel.producing.clear())
    it = iter(nostall.prefetch(CountingSource(3)))
    start = time.monotonic()
    with pytest.raises(ProducerDiedError, match="ended without delivering batch 0"):
        next(it)
    assert time.monotonic() - start < 10.0  # noticed, not waited for forever


# -- rows 19, 22: determinism, interleaving -----------------------------------------------------


class Noisy(Dataset[torch.Tensor]):
    """Random augmentation drawn from torch's generator (per worker when workers are used)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_seeded_shuffle_gives_identical_sequences(workers: int) -> None:
    """With a seeded generator, the stream is the same with and without nostall."""

    def loader() -> DataLoader[torch.Tensor]:
        return DataLoader(
            Noisy(),
            batch_size=4,
            shuffle=True,
            num_workers=workers,
            generator=torch.Generator().manual_seed(7),
        )

    torch.manual_seed(0)
    expected = list(loader())
    torch.manual_seed(0)
    if workers:
        assert_same_batches(expected, nostall.prefetch(loader()))
        return
    with warnings.catch_warnings():  # the loop draws nothing: loaded ahead, no warning
        warnings.simplefilter("error")
        assert_same_batches(expected, nostall.prefetch(loader()))


def test_two_prefetchers_interleaved_are_independent() -> None:
    """A training and a validation prefetcher used in turn keep their own streams."""
    train, val = CountingSource(10), DataLoader(as_dataset(range(6)), batch_size=2)
    p_train, p_val = nostall.prefetch(train), nostall.prefetch(val)
    out_train, out_val = [], []
    for t, v in zip(p_train, p_val, strict=False):  # stops at the shorter
        out_train.append(int(t))
        out_val.append(v.tolist())
    assert [0, 1, 2] == out_train  # zip stops at the shorter
    assert [[0, 1], [2, 3], [4, 5]] == out_val
    assert list(range(10)) == [int(t) for t in p_train]


# -- forwarding: len, attributes, set_epoch -----------------------------------------------------


def test_len_is_the_source_length() -> None:
    """len() is the loader's number of batches."""
    assert 4 == len(nostall.prefetch(make_loader(7, 0)))


def test_len_of_a_generator_raises_the_sources_type_error() -> None:
    """A source without len gives the same TypeError as the source itself."""
    gen = (i for i in range(3))
    with pytest.raises(TypeError) as expected:
        len(gen)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as actual:
        len(nostall.prefetch(gen))
    assert str(expected.value) == str(actual.value)


def test_attributes_are_forwarded_to_the_source() -> None:
    """dataset, sampler, batch_size and the rest read through."""
    loader = make_loader(7, 0, drop_last=True)
    p = nostall.prefetch(loader)
    assert p.dataset is loader.dataset
    assert p.sampler is loader.sampler
    assert 7 == p.batch_size
    assert p.drop_last is True
    with pytest.raises(AttributeError):
        p.no_such_attribute  # noqa: B018


@pytest.mark.parametrize("pin_memory", [False, True])
def test_every_loader_argument_reads_the_loaders_value(pin_memory: bool) -> None:
    """What ``DataLoader(...)`` keeps reads through as the loader's, whatever nostall was given.

    accelerate's ``skip_first_batches`` rebuilds a loader from these attributes; the
    prefetcher's own ``timeout`` or ``pin_memory`` read in their place made it fail or differ.
    """
    loader = DataLoader(
        as_dataset(list(range(10))),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=lambda samples: samples,
        pin_memory=pin_memory,
        drop_last=True,
        timeout=7.0,
        worker_init_fn=lambda worker: None,
        multiprocessing_context="spawn",
        generator=torch.Generator(),
        prefetch_factor=3,
        persistent_workers=True,
        in_order=False,
    )
    p = nostall.prefetch(loader, "cpu", timeout=60, pin_memory=not pin_memory, depth=4)
    arguments = inspect.signature(DataLoader.__init__).parameters
    kept = [name for name in arguments if name != "self" and hasattr(loader, name)]
    assert {"timeout", "pin_memory", "num_workers", "prefetch_factor", "in_order"} <= set(kept)
    for name in kept:
        assert getattr(loader, name) is getattr(p, name), name


def test_ray_rebuilding_a_loader_from_the_prefetcher_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray Train's prepare_data_loader reads the loader through it to build a new one: refused.

    Its code stands in here (Ray's test, tests/test_ray.py, runs the real one); the same
    function under another module, and other readers, read through as before.
    """
    p = nostall.prefetch(DataLoader(TensorDataset(torch.arange(8)), batch_size=2))
    source = (
        "def prepare_data_loader(loader, rebuild):\n"
        "    def with_sampler(loader):\n"
        "        return loader.dataset\n"
        "    return with_sampler(loader) if loader.sampler and rebuild else loader\n"
    )
    modules = ["ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils"]
    for module, refused in [*((m, True) for m in modules), ("mine", False)]:
        monkeypatch.setitem(sys.modules, module, types.ModuleType(module))  # as if imported
        scope: dict[str, Any] = {"__name__": module}
        exec(source, scope)
        assert scope["prepare_data_loader"](p, rebuild=False) is p  # Ray wraps it: it works
        if refused:
            with pytest.raises(TypeError, match=r"prefetch\(ray.train.torch.prepare_data_loader"):
                scope["prepare_data_loader"](p, rebuild=True)
        else:
            assert scope["prepare_data_loader"](p, rebuild=True) is p.dataset


def test_setting_a_loader_attribute_is_refused_as_the_loader_refuses_it() -> None:
    """``p.batch_size = 4`` raises the DataLoader's own error instead of shadowing it."""
    loader = make_loader(7, 0)
    p = nostall.prefetch(loader, "cpu")
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        p.batch_size = 4
    assert 7 == p.batch_size
    assert [7, 7, 7, 2] == [len(b["x"]) for b in p]


def test_setting_a_loader_attribute_the_loader_allows_applies_it() -> None:
    """An attribute the loader takes (its collate_fn) is set on the loader, where it acts."""
    loader = DataLoader(as_dataset(list(range(6))), batch_size=3)
    p = nostall.prefetch(loader, "cpu")
    p.collate_fn = lambda samples: sum(samples)
    assert loader.collate_fn is p.collate_fn
    assert [3, 12] == list(p)


def test_resetting_the_loaders_iterator_reaches_the_loader() -> None:
    """Lightning's teardown sets ``loader._iterator = None`` after shutting the workers down."""
    loader = DataLoader(
        as_dataset(list(range(4))), batch_size=2, num_workers=1, persistent_workers=True
    )
    p = nostall.prefetch(loader, "cpu")
    assert [[0, 1], [2, 3]] == [b.tolist() for b in p]
    workers = loader._iterator
    assert workers is not None
    p._iterator = None
    assert loader._iterator is None
    assert "_iterator" not in vars(p)
    assert [[0, 1], [2, 3]] == [b.tolist() for b in p]  # a new iterator, as the loader would
    p.close()


def test_new_attributes_stay_on_the_prefetcher() -> None:
    """A name the loader does not have is the prefetcher's own (user bookkeeping)."""
    loader = make_loader(7, 0)
    p = nostall.prefetch(loader, "cpu")
    p.my_note = "kept"
    assert "kept" == p.my_note
    assert not hasattr(loader, "my_note")


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ({"a": torch.ones(1)}, "its keys"),
        ("abc", "its characters"),
        (b"abc", "its bytes"),
        (torch.ones(3, 2), "its rows"),
    ],
)
def test_sources_iterated_by_accident_are_refused(source: Any, kind: str) -> None:
    """A dict, str, bytes or tensor is iterable, but not a source of batches."""
    with pytest.raises(TypeError, match=kind):
        nostall.prefetch(source)


class Numbers(Dataset[torch.Tensor]):
    """A map-style dataset: iterating it (through ``__getitem__``) yields single samples."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= 4:
            raise IndexError(i)
        return torch.tensor([i * i])


@pytest.mark.parametrize("dataset", [Numbers(), TensorDataset(torch.arange(4))])
def test_a_dataset_given_as_the_source_is_refused_with_the_fix(dataset: Any) -> None:
    """Its samples would be batches of one: refused, naming the DataLoader to pass."""
    name = type(dataset).__qualname__
    with pytest.raises(TypeError, match=rf"got a {name}, whose iteration yields its samples"):
        nostall.prefetch(dataset)
    with pytest.raises(TypeError, match=re.escape("DataLoader(dataset, batch_size=...)")):
        nostall.prefetch(dataset)
    loader = DataLoader(dataset, batch_size=2)
    assert [str(b) for b in loader] == [str(b) for b in nostall.prefetch(loader)]


class BatchesDataset(Dataset[torch.Tensor]):
    """A Dataset whose own ``__iter__`` yields batches: a source, as it says."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])

    def __iter__(self) -> Iterator[torch.Tensor]:
        yield from (torch.arange(i, i + 2) for i in range(0, 6, 2))


def test_a_dataset_that_iterates_batches_itself_is_a_source() -> None:
    assert [[0, 1], [2, 3], [4, 5]] == [b.tolist() for b in nostall.prefetch(BatchesDataset())]


def test_meta_device_is_refused() -> None:
    """Batches on the meta device hold no data."""
    with pytest.raises(ValueError, match="device='meta' holds no data"):
        nostall.prefetch([torch.ones(1)], "meta")


def test_set_epoch_reaches_a_distributed_sampler() -> None:
    """p.set_epoch(e) changes the order exactly as sampler.set_epoch(e) does."""

    def loader() -> DataLoader[int]:
        data = list(range(16))
        sampler: DistributedSampler[int] = DistributedSampler(
            as_dataset(data), num_replicas=2, rank=0, shuffle=True, seed=3
        )
        return DataLoader(as_dataset(data), batch_size=4, sampler=sampler)

    plain, wrapped = loader(), loader()
    p = nostall.prefetch(wrapped)
    for epoch in range(3):
        plain.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        p.set_epoch(epoch)
        assert_same_batches(plain, p)
    assert 2 == wrapped.sampler.epoch  # type: ignore[attr-defined]


def test_set_epoch_order_of_lookup() -> None:
    """The source first, then its sampler, then its batch_sampler's sampler."""

    class Recorder:
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, e: int) -> None:
            self.epochs.append(e)

    class WithSampler(list[int]):
        sampler = Recorder()

    class WithBatchSampler(list[int]):
        sampler = object()
        batch_sampler = type("B", (), {"sampler": Recorder()})()

    src1 = WithSampler([1])
    nostall.prefetch(src1).set_epoch(4)
    assert [4] == src1.sampler.epochs
    src2 = WithBatchSampler([1])
    nostall.prefetch(src2).set_epoch(5)
    assert [5] == src2.batch_sampler.sampler.epochs
    nostall.prefetch([1, 2]).set_epoch(6)  # nothing has it: no error


# -- one-shot sources ---------------------------------------------------------------------------


def test_second_epoch_of_an_exhausted_generator_is_empty_with_a_warning() -> None:
    """A generator cannot restart; nostall says so instead of silently yielding nothing."""
    p = nostall.prefetch(torch.tensor([i]) for i in range(3))
    assert [0, 1, 2] == [int(t) for t in p]
    with pytest.warns(UserWarning, match="one-shot iterator that is exhausted"):
        assert [] == list(p)


def test_a_generator_that_raised_gives_an_empty_next_epoch_with_a_warning() -> None:
    """As for one that ended: its error surfaces, then the next pass warns, never silent."""

    def source() -> Iterator[torch.Tensor]:
        yield torch.tensor([0])
        yield torch.tensor([1])
        raise OSError("truncated record 2")

    p = nostall.prefetch(source())
    batches = iter(p)
    assert [0, 1] == [int(next(batches)), int(next(batches))]
    with pytest.raises(OSError, match="truncated record 2"):
        next(batches)
    with pytest.warns(UserWarning, match="one-shot iterator that is exhausted"):
        assert [] == list(p)


class Rearming(DataLoader[Any]):
    """A DataLoader that is its own iterator, re-armed by ``__iter__`` (as Ray Train's is).

    A plain ``for`` loop gets a new epoch from it each time.
    """

    def __iter__(self) -> Rearming:  # type: ignore[override]
        self._batches = super().__iter__()
        return self

    def __next__(self) -> Any:
        return next(self._batches)


@pytest.mark.parametrize("across_epochs", [False, True])
def test_an_iterator_that_restarts_on_iter_gives_every_epoch(across_epochs: bool) -> None:
    """Every epoch the plain loop gets, in the same order (the shuffle seeded alike)."""

    def loader() -> Rearming:
        g = torch.Generator().manual_seed(0)
        return Rearming(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True, generator=g)

    plain_source = loader()
    plain = [[b.tolist() for (b,) in plain_source] for _ in range(3)]
    p = nostall.prefetch(loader(), across_epochs=across_epochs)
    assert plain == [[b.tolist() for (b,) in p] for _ in range(3)]
    assert all(len(epoch) == 3 for epoch in plain)


class Wrapping(DataLoader[Any]):
    """Holds a loader and iterates it, as Ray Train's prepared loader does.

    Its attributes are the held loader's, copied; it is its own iterator, re-armed by
    ``__iter__``.
    """

    def __init__(self, inner: DataLoader[Any]) -> None:
        self.__dict__.update(inner.__dict__)
        self._inner = inner

    def __iter__(self) -> Wrapping:  # type: ignore[override]
        self._batches = iter(self._inner)
        return self

    def __next__(self) -> Any:
        return next(self._batches)


@pytest.mark.parametrize("across_epochs", [False, True])
def test_an_iterator_that_restarts_on_iter_resumes_mid_epoch(across_epochs: bool) -> None:
    """Resumed mid-epoch, it gives the rest of the epoch, not the epoch's first batches again.

    Its ``__iter__`` iterates a loader of its own: a copy with a skipping sampler would give
    the whole epoch again (Ray Train's prepared loader did), so the batches are pulled.
    """

    def loader() -> Wrapping:
        g = torch.Generator().manual_seed(0)
        dataset = TensorDataset(torch.arange(16))
        return Wrapping(DataLoader(dataset, batch_size=2, shuffle=True, generator=g))

    p = nostall.prefetch(loader(), across_epochs=across_epochs)
    first = [b.tolist() for (b,) in p]
    second = iter(p)
    seen = [next(second)[0].tolist() for _ in range(3)]
    state = p.state_dict()
    rest = [b.tolist() for (b,) in second]
    p.close()

    resumed = nostall.prefetch(loader(), across_epochs=across_epochs)
    resumed.load_state_dict(state)
    assert rest == [b.tolist() for (b,) in resumed]
    assert sorted(i for batch in seen + rest for i in batch) == list(range(16))
    assert first != seen + rest


@pytest.mark.usefixtures("fast_worker_shutdown")
def test_a_loader_that_iterates_a_persistent_loader_it_holds_resumes_its_order() -> None:
    """As Ray's prepared loader over a loader with persistent workers (one Ray worker).

    Its own ``_iterator`` is a stale copy of its loader's: the record must read the held
    loader's, or the resumed epoch draws its order where the workers' seed was drawn.
    """

    def loader() -> Wrapping:
        dataset = TensorDataset(torch.arange(32))
        inner = DataLoader(
            dataset, batch_size=4, shuffle=True, num_workers=1, persistent_workers=True
        )
        return Wrapping(inner)

    torch.manual_seed(0)
    p = nostall.prefetch(loader())
    [b for b in p]
    it = iter(p)
    [next(it) for _ in range(3)]
    state, rng = p.state_dict(), torch.get_rng_state()
    rest = [b[0].tolist() for b in it]
    p.close()
    torch.manual_seed(0)
    resumed = nostall.prefetch(loader())
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert rest == [b[0].tolist() for b in resumed]
    resumed.close()


def test_a_loader_subclass_that_iterates_itself_resumes_loading_no_skipped_sample() -> None:
    """Its ``__iter__`` goes through torch's: a copy with a skipping sampler is still exact."""
    loaded: list[int] = []

    class Hooked(DataLoader[Any]):
        """Adds a step to each batch, as many loaders of one's own do."""

        def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
            for (batch,) in super().__iter__():
                yield batch * 10

    def loader() -> Hooked:
        class Counted(TensorDataset):
            def __getitem__(self, i: int) -> Any:
                loaded.append(i)
                return super().__getitem__(i)  # type: ignore[no-untyped-call]

        g = torch.Generator().manual_seed(0)
        return Hooked(Counted(torch.arange(16)), batch_size=2, shuffle=True, generator=g)

    p = nostall.prefetch(loader())
    it = iter(p)
    [next(it) for _ in range(5)]
    state = p.state_dict()
    rest = [b.tolist() for b in it]
    p.close()
    loaded.clear()
    resumed = nostall.prefetch(loader())
    resumed.load_state_dict(state)
    assert rest == [b.tolist() for b in resumed]
    assert 16 - 10 == len(loaded)  # the first five batches were skipped, not loaded


def test_breaking_out_of_a_generator_loses_nothing() -> None:
    """Batches fetched ahead for a one-shot source are handed to the next iteration."""
    pulled = []

    def source() -> Iterator[torch.Tensor]:
        for i in range(10):
            pulled.append(i)
            yield torch.tensor([i])

    p = nostall.prefetch(source(), depth=4)
    first = []
    for batch in p:
        first.append(int(batch))
        if len(first) == 3:
            wait_until(lambda: len(pulled) >= 6, "the producer fetched ahead")
            break
    rest = [int(t) for t in p]
    assert list(range(10)) == first + rest


# -- placement (row 18, off CUDA) and threads ---------------------------------------------------


def staged_on_meta(batches: list[Any]) -> list[Any]:
    """The prefetcher's staging step to the meta device, the one non-CPU device everywhere.

    (The prefetcher itself refuses device="meta": nothing can be computed on what it yields.)
    """
    from nostall._staging.base import Staging

    staging = Staging(torch.device("meta"))
    return [staging.hand_out(staging.stage(b)) for b in batches]


def test_every_tensor_reaches_the_target_device() -> None:
    """On the meta device (available everywhere) every tensor leaf moves, dtypes kept."""
    batches = [{"x": torch.ones(2, dtype=torch.float16), "ids": [torch.arange(3)], "s": "a"}] * 3
    for batch in staged_on_meta(batches):
        assert "meta" == batch["x"].device.type
        assert torch.float16 == batch["x"].dtype
        assert "meta" == batch["ids"][0].device.type
        assert torch.int64 == batch["ids"][0].dtype
        assert "a" == batch["s"]


def test_structure_is_kept_through_the_prefetcher() -> None:
    """Row 21 end to end: every container type survives the trip, every tensor moves."""
    from collections import OrderedDict, defaultdict
    from dataclasses import dataclass
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: torch.Tensor
        b: str

    @dataclass(frozen=True)
    class Item:
        x: torch.Tensor
        n: int

    class Own:
        def to(self, device: Any, non_blocking: bool = False) -> str:
            return f"moved to {device}"

    counts: defaultdict[str, Any] = defaultdict(int, k=torch.ones(1))
    batch = {
        "od": OrderedDict(z=torch.ones(1), a=None),
        "dd": counts,
        "nt": Pair(torch.ones(1), "s"),
        "dc": Item(torch.ones(1), 3),
        "own": Own(),
        "nested": {"deeper": [(torch.ones(1), 7, b"b")]},
    }
    (out,) = staged_on_meta([batch])
    assert type(out["od"]) is OrderedDict
    assert ["z", "a"] == list(out["od"])
    assert "meta" == out["od"]["z"].device.type
    assert int is out["dd"].default_factory
    assert type(out["nt"]) is Pair
    assert "s" == out["nt"].b
    assert "meta" == out["dc"].x.device.type
    assert 3 == out["dc"].n
    assert "moved to meta" == out["own"]
    assert "meta" == out["nested"]["deeper"][0][0].device.type
    assert (7, b"b") == out["nested"]["deeper"][0][1:]


def test_producer_threads_are_named() -> None:
    """Threads are named nostall-prefetch-N and are daemons."""
    it = iter(nostall.prefetch(CountingSource(100)))
    next(it)
    (thread,) = nostall_threads()
    assert thread.name.startswith("nostall-prefetch-")
    assert thread.daemon
    it.close()


@pytest.mark.perf
def test_loading_overlaps_compute() -> None:
    """Loading and a GIL-releasing step of equal length overlap: far below the serial sum."""
    source = CountingSource(12, delay=0.05)
    start = time.perf_counter()
    for _ in nostall.prefetch(source):
        time.sleep(0.05)  # the step
    elapsed = time.perf_counter() - start
    serial = 12 * 0.1
    assert elapsed < 0.8 * serial, f"{elapsed:.2f} s, serial would be {serial:.2f} s"


# -- bad input ----------------------------------------------------------------------------------


def test_not_iterable_is_a_type_error_naming_the_type() -> None:
    """The message names what was received."""
    with pytest.raises(TypeError, match="got 42, an int"):
        nostall.prefetch(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("depth", [0, -1])
def test_bad_depth_value(depth: int) -> None:
    """depth must be >= 1: a ValueError that shows the value received."""
    with pytest.raises(ValueError, match=rf"depth=\.\.\.\) must be >= 1 .*\(got depth={depth}\)"):
        nostall.prefetch([1], depth=depth)


@pytest.mark.parametrize("depth", [1.5, "2", True, None])
def test_bad_depth_type(depth: Any) -> None:
    """depth of another type than int or "auto": a TypeError naming what was received."""
    with pytest.raises(TypeError, match=r"depth=\.\.\.\) must be an int >= 1 or \"auto\" \(got"):
        nostall.prefetch([1], depth=depth)


@pytest.mark.parametrize("timeout", [-1, 0, float("nan")])
def test_bad_timeout_value(timeout: float) -> None:
    """timeout must be None or a positive number."""
    with pytest.raises(
        ValueError, match=r"timeout=\.\.\.\) must be None or a number of seconds > 0"
    ):
        nostall.prefetch([1], timeout=timeout)


@pytest.mark.parametrize("timeout", ["1", True])
def test_bad_timeout_type(timeout: Any) -> None:
    with pytest.raises(TypeError, match=r"timeout=\.\.\.\) must be None or a number of seconds"):
        nostall.prefetch([1], timeout=timeout)


@pytest.mark.parametrize("name", ["pin_memory", "across_epochs", "profile", "shard"])
def test_bad_flags(name: str) -> None:
    """Flags are booleans (pin_memory and shard may be None): a TypeError naming the flag."""
    with pytest.raises(TypeError, match=rf"{name}=\.\.\.\) must be True.* \(got 'yes', a str\)"):
        nostall.prefetch([1], **{name: "yes"})  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_requested_without_cuda() -> None:
    """A DeviceUnavailableError at construction that says what to pass instead."""
    with pytest.raises(DeviceUnavailableError, match="device='cpu'") as info:
        nostall.prefetch([1], "cuda")
    assert isinstance(info.value, RuntimeError)


def test_default_device_without_cuda_is_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """device=None means the CPU where CUDA is missing."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert torch.device("cpu") == Prefetcher([1]).device


def test_repr_names_source_device_and_state() -> None:
    """repr is short and useful."""
    p = nostall.prefetch([1], "cpu", depth=3)
    assert "Prefetcher(source=list, device='cpu', depth=3, open)" == repr(p)


# -- CUDA: rows 16-18 (run on a GPU machine; skipped without CUDA) ------------------------------


def _filled(n: int, size: int = 1 << 18) -> list[torch.Tensor]:
    """CPU batches whose every element is the batch's index (1 MiB of float32 each)."""
    return [torch.full((size,), float(i)) for i in range(n)]


def _check_stream_safety(p: Prefetcher[torch.Tensor], steps: int, read_late: bool = False) -> int:
    """Consume ``steps`` batches, overwriting each after use; count the batches read wrong.

    By default each batch is read right after it is handed out (a missing wait shows: the
    read can overtake the copy), and the consumer's stream is then kept busy so the copies run
    ahead. With ``read_late`` the busy work comes first, so the read runs late on the GPU while
    the host has moved on and dropped the batch (a missing ``record_stream`` shows: its memory
    is reused by a later copy before the read).
    """
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    for i, batch in enumerate(p):
        if read_late:
            torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]
        bad += (batch != float(i)).any().to(torch.int64)
        if not read_late:
            torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]
        batch.fill_(-1.0)  # overwrite after use, then drop it
        del batch
    torch.cuda.synchronize()
    return int(bad.item())


@pytest.mark.cuda
@pytest.mark.parametrize("read_late", [False, True])
def test_cuda_stream_safety_under_a_busy_compute_stream(read_late: bool) -> None:
    """1000 steps with a busy consumer stream: every batch equals its CPU reference."""
    p = nostall.prefetch(_filled(1000), "cuda", depth=3)
    assert 0 == _check_stream_safety(p, 1000, read_late)


@pytest.mark.cuda
@pytest.mark.parametrize("read_late", [False, True])
def test_cuda_stream_safety_on_a_side_consumer_stream(read_late: bool) -> None:
    """The consumer's current stream, whatever it is, is the one that waits."""
    p = nostall.prefetch(_filled(200), "cuda", depth=2)
    assert 0 == _check_on_a_side_stream(p, 200, read_late)


def _check_on_a_side_stream(p: Prefetcher[torch.Tensor], steps: int, read_late: bool) -> int:
    with torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        return _check_stream_safety(p, steps, read_late)


def _made_on_the_device(n: int, size: int = 1 << 18) -> Iterator[torch.Tensor]:
    """Batches a source writes on the GPU itself, late on its thread's stream."""
    for i in range(n):
        batch = torch.zeros(size, device="cuda")
        torch.cuda._sleep(5_000_000)  # type: ignore[no-untyped-call]  # the write below lands well after the batch is yielded
        batch.fill_(float(i))
        yield batch


@pytest.mark.cuda
def test_cuda_source_made_batches_are_waited_for_on_a_side_stream() -> None:
    """The consumer waits for the source's own device work, not only for nostall's copies."""
    p = nostall.prefetch(_made_on_the_device(30), "cuda", depth=2)
    assert 0 == _check_on_a_side_stream(p, 30, read_late=False)


#: How long each copy of the wait canary sleeps on the copy stream first: about 10 ms.
LATE_COPY_CYCLES = 20_000_000


def _copies_start_late(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host-to-device copy of the staging starts LATE_COPY_CYCLES late on the copy stream.

    Staging as nostall does it (pinned, then a non-blocking copy on the copy stream, every
    copy kept for ``record_stream``), but the copy's output is allocated first and the copy
    stream sleeps before the copy: an allocation that synchronises the device (a new block)
    happens before the sleep is queued. So the copy is still pending when the batch is handed
    out, however busy the GPU is with other processes' work.
    """
    from nostall._staging.cuda import CudaStaging

    def leaf_mover(
        self: CudaStaging, out: list[torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def move(t: torch.Tensor) -> torch.Tensor:
            pinned = t.pin_memory()
            copy = torch.empty(pinned.shape, dtype=pinned.dtype, device=self.device)
            torch.cuda._sleep(LATE_COPY_CYCLES)  # type: ignore[no-untyped-call]
            copy.copy_(pinned, non_blocking=True)
            out.append(copy)
            return copy

        return move

    monkeypatch.setattr(CudaStaging, "_leaf_mover", leaf_mover)


@pytest.mark.cuda
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_cuda_late_copies_are_waited_for(monkeypatch: pytest.MonkeyPatch, consumer: str) -> None:
    """The canary's late copies, with the consumer's wait: every batch read right."""
    _copies_start_late(monkeypatch)
    p = nostall.prefetch(_filled(40), "cuda", depth=2)
    check = _check_stream_safety if consumer == "default" else _check_on_a_side_stream
    assert 0 == check(p, 40, False)


@pytest.mark.cuda
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_cuda_canary_without_the_wait(monkeypatch: pytest.MonkeyPatch, consumer: str) -> None:
    """The check has teeth: without the consumer's wait, a read right away overtakes the copy.

    Every copy starts late, so the read is queued, and runs, before its copy whatever else
    runs on the GPU: with a copy that merely ran long, another process's kernels (the suite
    under xdist) sometimes let it finish first and the canary saw nothing.
    """
    from nostall._staging.cuda import CudaStaging

    monkeypatch.setattr(CudaStaging, "_wait", staticmethod(lambda consumer, ready: None))
    _copies_start_late(monkeypatch)
    p = nostall.prefetch(_filled(40), "cuda", depth=2)
    check = _check_stream_safety if consumer == "default" else _check_on_a_side_stream
    assert check(p, 40, False) > 0


@pytest.mark.cuda
@pytest.mark.parametrize("consumer", ["default", "side"])
def test_cuda_canary_without_record_stream(monkeypatch: pytest.MonkeyPatch, consumer: str) -> None:
    """The check has teeth: without record_stream, a late read sees a later batch's copy."""
    from nostall._staging.cuda import CudaStaging

    monkeypatch.setattr(
        CudaStaging, "_keep_for_consumer", staticmethod(lambda consumer, tensors: None)
    )
    p = nostall.prefetch(_filled(300), "cuda", depth=2)
    check = _check_stream_safety if consumer == "default" else _check_on_a_side_stream
    assert check(p, 300, True) > 0


@pytest.mark.cuda
def test_cuda_second_device() -> None:
    """A prefetcher for cuda:1 while cuda:0 is current: batches land there, safely."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    p = nostall.prefetch(_filled(100), "cuda:1", depth=2)
    bad = torch.zeros((), dtype=torch.int64, device="cuda:1")
    for i, batch in enumerate(p):
        assert batch.device == torch.device("cuda", 1)
        bad += (batch != float(i)).any().to(torch.int64)
        batch.fill_(-1.0)
    torch.cuda.synchronize(1)
    assert torch.cuda.current_device() == 0
    assert 0 == int(bad.item())


@pytest.mark.cuda
def test_cuda_reserved_memory_flat_over_20_epochs_and_one_stream() -> None:
    """Reserved memory does not grow epoch after epoch; one copy stream per prefetcher."""
    loader = DataLoader(TensorDataset(torch.randn(64, 4096)), batch_size=8)
    p = nostall.prefetch(loader, "cuda")
    stream = p._staging.stream  # type: ignore[attr-defined]
    reserved = []
    for _ in range(20):
        for (batch,) in p:
            batch.mul_(2)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        assert stream is p._staging.stream  # type: ignore[attr-defined]
    assert reserved[2] == reserved[-1], reserved


@pytest.mark.cuda
def test_cuda_reserved_memory_flat_with_a_prefetcher_per_epoch() -> None:
    """A new prefetcher each epoch reuses the copy stream (and its cached blocks) of the last.

    Before copy streams were lent again: 6, 8, 10, 12, 14, 16 MiB on an H100.
    """
    data = [torch.randn(256, 1024) for _ in range(16)]  # 1 MiB batches
    reserved = []
    for _ in range(8):
        for batch in nostall.prefetch(data, "cuda"):
            batch.mul_(2)
        assert not wait_for_no_nostall_threads(timeout=5.0)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[2] == reserved[-1], reserved


@pytest.mark.cuda
def test_cuda_at_most_depth_batches_in_flight() -> None:
    """GPU memory held ahead of the consumer stays within depth batches (plus the one in use)."""
    size = 1 << 20  # 4 MiB per batch
    depth = 2
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    it = iter(nostall.prefetch(_filled(20, size), "cuda", depth=depth))
    batch = next(it)
    time.sleep(0.5)  # the producer fills its slots
    held = torch.cuda.memory_allocated() - base
    assert held <= (depth + 1) * size * 4, f"{held / 2**20:.1f} MiB held"
    del batch
    it.close()


@pytest.mark.cuda
def test_cuda_placement_and_dtypes() -> None:
    """Every tensor leaf on the target device with its dtype; other leaves unchanged."""
    sample: dict[str, Any] = {
        "image": torch.randint(0, 255, (2, 3, 4, 4), dtype=torch.uint8),
        "label": torch.tensor([1, 2]),
        "weights": [torch.ones(2, dtype=torch.float16)],
        "name": "a",
        "n": None,
        "already": torch.ones(1, device="cuda"),
    }
    (out,) = list(nostall.prefetch([sample], "cuda:0"))
    assert torch.device("cuda", 0) == out["image"].device
    assert torch.uint8 == out["image"].dtype
    assert torch.int64 == out["label"].dtype
    assert torch.float16 == out["weights"][0].dtype
    assert "cuda" == out["weights"][0].device.type
    assert "a" == out["name"]
    assert out["n"] is None
    assert torch.equal(sample["image"], out["image"].cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("pin", [True, False])
def test_cuda_non_blocking_only_from_pinned_memory(
    pin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies are asynchronous exactly when their source is pinned."""
    calls: list[tuple[bool, bool]] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "cpu":
            calls.append((self.is_pinned(), bool(kwargs.get("non_blocking", False))))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    list(nostall.prefetch(_filled(4, 16), "cuda", pin_memory=pin))
    assert 4 == len(calls)
    assert all(pinned == non_blocking for pinned, non_blocking in calls), calls
    assert all(pinned is pin for pinned, _ in calls), calls


@pytest.mark.cuda
def test_cuda_default_device_is_the_current_one() -> None:
    """device=None picks the current CUDA device when CUDA is present."""
    assert torch.device("cuda", torch.cuda.current_device()) == nostall.prefetch([1]).device


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_same_batches_as_the_loader(workers: int) -> None:
    """The golden check on CUDA, with a pinning DataLoader too."""
    loader = make_loader(7, workers, pin_memory=True)
    p = nostall.prefetch(loader, "cuda")
    for _ in range(2):
        assert_same_batches(loader, p)
