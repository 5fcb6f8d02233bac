"""threads=N over an IterableDataset: the batches, in the order, of N worker processes."""

from __future__ import annotations

import os
import sqlite3
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import assert_same_batches, wait_for_no_nostall_threads
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import nostall
from nostall._sources.global_draws import GlobalDrawsWarning

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The reference loaders start 3 worker processes on a 2-core machine, which torch warns of.
# webdataset leaves a shard's file to the garbage collector (with worker processes too).
pytestmark = [
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning"),
]


class Shards(IterableDataset[torch.Tensor]):
    """Shards of uneven lengths; each worker reads every num_workers-th shard.

    Reads ``get_worker_info`` as most datasets do: imported from ``torch.utils.data``. Each
    item holds the shard, its place and the worker's seed, so that the seeds are compared too.
    """

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        seed = 0 if info is None else info.seed
        shards = list(range(len(self.lengths)))
        if self.epoch:  # another order of shards each epoch, as a stream shuffles them
            shards = shards[self.epoch % len(shards) :] + shards[: self.epoch % len(shards)]
        for shard in shards[worker::workers]:
            for i in range(self.lengths[shard]):
                yield torch.tensor([shard, i, seed % 1000])


def with_processes(dataset: Any, workers: int, **loader: Any) -> list[Any]:
    """The batches of the loader built with ``num_workers=workers``, the reference."""
    torch.manual_seed(7)
    return list(DataLoader(dataset, num_workers=workers, **loader))


def with_threads(dataset: Any, workers: int, **loader: Any) -> list[Any]:
    """The batches of ``prefetch(DataLoader(num_workers=0), threads=workers)``."""
    torch.manual_seed(7)
    with nostall.prefetch(DataLoader(dataset, **loader), "cpu", threads=workers) as p:
        return list(p)


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize(
    "loader",
    [
        {"batch_size": 4},
        {"batch_size": 4, "drop_last": True},
        {"batch_size": None},
    ],
    ids=["batched", "drop_last", "unbatched"],
)
def test_the_batches_and_order_of_n_worker_processes(workers: int, loader: dict[str, Any]) -> None:
    """Uneven shards, workers ending at different turns: the same batches, same order, seeds."""
    dataset = Shards([9, 2, 7, 0, 5, 11])
    expected = with_processes(dataset, workers, **loader)
    assert_same_batches(expected, with_threads(dataset, workers, **loader))


def test_each_thread_is_its_own_worker() -> None:
    """``get_worker_info()`` answers each thread its worker id, of N, in a loading thread."""
    seen: dict[int, set[str]] = {}
    lock = threading.Lock()

    class Who(IterableDataset[int]):
        def __iter__(self) -> Iterator[int]:
            info = get_worker_info()
            assert info is not None
            for i in range(20):
                with lock:
                    seen.setdefault(info.id, set()).add(threading.current_thread().name)
                yield info.id * 100 + i

    batches = with_threads(Who(), 3, batch_size=5)
    assert {0, 1, 2} == set(seen)
    # One thread per worker for the whole epoch, also while nostall checks, at the first
    # turns, that the dataset draws nothing from the global generators.
    assert all(1 == len(names) for names in seen.values()), seen
    names = set().union(*seen.values())
    assert {f"nostall-load-{i}" for i in range(3)} == names
    assert [b[0].item() // 100 for b in batches] == [0, 1, 2] * 4  # in turn


class PerWorkerConnection(IterableDataset[torch.Tensor]):
    """Opens a SQLite connection in ``__iter__``, which only the opening thread may use."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        connection = sqlite3.connect(":memory:")  # check_same_thread: True
        try:
            connection.execute("create table items (i integer)")
            connection.executemany("insert into items values (?)", [(i,) for i in range(24)])
            rows = connection.execute("select i from items order by i").fetchall()
            for (i,) in rows[worker::workers]:
                yield torch.tensor([i, connection.execute("select ?", (i,)).fetchone()[0]])
        finally:
            connection.close()


@pytest.mark.parametrize("draws", [False, True], ids=["quiet", "draws"])
def test_a_handle_opened_in_iter_stays_in_its_thread(draws: bool) -> None:
    """Each worker's iterator is advanced in the thread that made it, drawing or not."""
    expected = with_processes(PerWorkerConnection(), 2, batch_size=3)
    if not draws:
        assert_same_batches(expected, with_threads(PerWorkerConnection(), 2, batch_size=3))
        return
    # A dataset that draws from the global generator: each thread's draws go to its worker's
    # own generator, seeded as torch seeds worker process w: the draws of worker processes,
    # in parallel, with no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", GlobalDrawsWarning)
        threaded = with_threads(DrawsToo(PerWorkerConnection()), 2, batch_size=3)
    assert_same_batches(with_processes(DrawsToo(PerWorkerConnection()), 2, batch_size=3), threaded)
    assert_same_batches(expected, [items for items, _ in threaded])


class DrawsToo(IterableDataset[Any]):
    """Each item with a draw from torch's global generator, as a random augmentation makes."""

    def __init__(self, inner: IterableDataset[torch.Tensor]) -> None:
        self.inner = inner

    def __iter__(self) -> Iterator[Any]:
        for item in self.inner:
            yield item, torch.rand(())


def test_a_streams_batches_are_not_put_in_shared_memory() -> None:
    """Threads need no shared memory: default_collate makes ordinary tensors, as in a loop."""
    for batch in with_threads(Shards([4, 4, 4]), 2, batch_size=2):
        assert not batch.is_shared()


def test_set_epoch_reaches_the_dataset_before_its_workers_iterate() -> None:
    """``set_epoch`` on the prefetcher: each epoch's shard order, as the plain loop's."""
    dataset = Shards([3, 4, 5, 6])
    p = nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2)
    for epoch in range(3):
        p.set_epoch(epoch)
        torch.manual_seed(epoch)
        got = list(p)
        torch.manual_seed(epoch)
        expected = list(DataLoader(dataset, batch_size=2, num_workers=2))  # epoch is set
        assert_same_batches(expected, got)
    p.close()


class Failing(IterableDataset[torch.Tensor]):
    """Worker 1's items raise at its third; as an iterator object that goes on, or a generator."""

    def __init__(self, generator: bool) -> None:
        self.generator = generator

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        if self.generator:
            return self._generate(worker)
        return _GoesOn(worker)

    def _generate(self, worker: int) -> Iterator[torch.Tensor]:
        for i in range(6):
            if worker == 1 and i == 2:
                raise ValueError(f"bad item {i} of worker {worker}")
            yield torch.tensor([worker, i])


class _GoesOn(Iterator[torch.Tensor]):
    def __init__(self, worker: int) -> None:
        self.worker, self.i = worker, 0

    def __next__(self) -> torch.Tensor:
        i, self.i = self.i, self.i + 1
        if i >= 6:
            raise StopIteration
        if self.worker == 1 and i == 2:
            raise ValueError(f"bad item {i} of worker {self.worker}")
        return torch.tensor([self.worker, i])


def outcomes(loader: Any) -> list[Any]:
    """Each ``next()``: the batch, or the error's type; a loop that catches errors and goes on."""
    it, seen = iter(loader), []
    while True:
        try:
            seen.append(next(it).tolist())
        except StopIteration:
            return seen
        except ValueError:
            seen.append("ValueError")


@pytest.mark.parametrize("generator", [False, True], ids=["iterator", "generator"])
def test_an_error_comes_at_its_workers_turn_and_the_epoch_goes_on(generator: bool) -> None:
    """A worker's error is raised at its turn; the others go on, as with worker processes."""
    dataset = Failing(generator)
    expected = outcomes(DataLoader(dataset, batch_size=2, num_workers=2))
    with nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2) as p:
        assert expected == outcomes(p)


class FailingFirst(IterableDataset[torch.Tensor]):
    """Split by worker in ``__iter__``; each worker's first item raises, the rest follow."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        return _FirstFails(0 if info is None else info.id)


class _FirstFails(Iterator[torch.Tensor]):
    def __init__(self, worker: int) -> None:
        self.worker, self.i = worker, 0

    def __next__(self) -> torch.Tensor:
        i, self.i = self.i, self.i + 1
        if i >= 5:
            raise StopIteration
        if i == 0:
            raise ValueError(f"bad first item of worker {self.worker}")
        return torch.tensor([self.worker, i])


def test_a_worker_whose_first_batch_raises_is_known_to_have_split() -> None:
    """Its __iter__ asked which worker it is before the error: not refused later as unsplit.

    It was: the next batch raised NotSplitError and the epoch ended (12 of 39 items where the
    DataLoader delivers 39 and one error).
    """
    expected = outcomes(DataLoader(FailingFirst(), batch_size=2, num_workers=2))
    assert 2 == expected.count("ValueError")
    with nostall.prefetch(DataLoader(FailingFirst(), batch_size=2), "cpu", threads=2) as p:
        assert expected == outcomes(p)


def test_a_break_leaves_no_loading_thread() -> None:
    """Leaving an epoch mid-way and closing stops every worker's thread."""
    p = nostall.prefetch(DataLoader(Shards([50] * 4), batch_size=2), "cpu", threads=4)
    for i, _ in enumerate(p):
        if i == 3:
            break
    p.close()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)


def test_a_state_saved_mid_epoch_resumes_the_rest() -> None:
    """``state_dict`` after 5 batches; a fresh prefetcher loading it yields the rest."""
    dataset = Shards([9, 2, 7, 5])
    full = with_threads(dataset, 2, batch_size=2)  # seeded as below
    torch.manual_seed(7)
    p = nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2)
    it = iter(p)
    head = [next(it) for _ in range(5)]
    state = p.state_dict()
    p.close()
    q = nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2)
    q.load_state_dict(state)
    assert_same_batches(full, head + list(q))
    q.close()


@pytest.mark.parametrize(
    ("saved", "resumed"), [(2, 3), (2, None), (None, 2), ("workers", 3)], ids=str
)
def test_a_stream_state_resumed_with_another_reader_count_is_refused(
    saved: int | str | None, resumed: int | None
) -> None:
    """Its batches take the readers' items in turn: another count would lose and repeat items.

    (It did, silently: 15 of 19 save points were wrong.) The same count resumes (above).
    """
    dataset = Shards([9, 2, 7, 5])
    workers = 2 if saved == "workers" else 0
    threads = saved if isinstance(saved, int) else None
    loader = DataLoader(dataset, batch_size=2, num_workers=workers)
    with nostall.prefetch(loader, "cpu", threads=threads) as p:
        it = iter(p)
        for _ in range(3):
            next(it)
        state = p.state_dict()
    here = nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=resumed)
    again = "threads=2" if saved is not None else "leave threads= out"
    with pytest.raises(ValueError, match=rf"read the stream.*lose some items.*{again}"):
        here.load_state_dict(state)
    here.close()


def test_a_webdataset_pipeline_is_split_between_threads_as_between_workers(
    tmp_path: Any,
) -> None:
    """webdataset's WebDataset splits its shards by worker: threads get the workers' shares."""
    wds = pytest.importorskip("webdataset")
    urls = []
    for s in range(4):
        url = str(tmp_path / f"shard-{s}.tar")
        with wds.TarWriter(url) as sink:
            for i in range(3 + s):
                sink.write({"__key__": f"{s}-{i}", "x.pth": torch.tensor([s, i])})
        urls.append(url)
    dataset = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("x.pth")
    expected = with_processes(dataset, 2, batch_size=3)
    assert_same_batches(expected, with_threads(dataset, 2, batch_size=3))


def test_a_hugging_face_stream_is_split_between_threads_as_between_workers() -> None:
    """A ``datasets`` IterableDataset of 4 shards: each thread reads a worker's shards."""
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"y": list(range(30))})
    stream = table.to_iterable_dataset(num_shards=4).with_format("torch")
    expected = with_processes(stream, 2, batch_size=4)
    assert_same_batches(expected, with_threads(stream, 2, batch_size=4))


class Whole(IterableDataset[torch.Tensor]):
    """Never asks which worker it is: each worker process (or thread) reads all of it."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.arange(6))


def test_a_dataset_that_never_asks_its_worker_is_refused_not_repeated() -> None:
    """Every item N times would be silent: the epoch raises, naming the fix, and ends."""
    p = nostall.prefetch(DataLoader(Whole(), batch_size=2), "cpu", threads=2)
    it = iter(p)
    with pytest.raises(ValueError, match=r"every item 2 times.*get_worker_info\(\)\.id"):
        next(it)
    assert [] == list(it)
    p.close()


def test_one_thread_reads_a_dataset_that_never_asks() -> None:
    """threads=1 reads it once, as one worker process does: nothing repeated, nothing refused."""
    assert_same_batches(
        with_processes(Whole(), 1, batch_size=2), with_threads(Whole(), 1, batch_size=2)
    )


def test_a_kept_error_does_not_hold_the_next_epochs_threads() -> None:
    """A loop keeps an error (its frames hold the epoch's stream): the next epoch still loads."""
    kept = []
    dataset = Failing(generator=True)
    p = nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2, timeout=60)
    for _ in range(2):
        try:
            for _batch in p:
                pass
        except ValueError as error:
            kept.append(error)  # a logger, or a notebook's sys.last_value, keeps it
    assert 2 == len(kept)
    p.close()


def test_a_pinning_error_comes_at_its_turn_and_the_worker_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error after the dataset (pinning) is that batch's, as torch's pin thread raises it."""
    import nostall._loading.threaded_stream as module

    def pin(batch: torch.Tensor) -> torch.Tensor:
        if batch[0, 1].item() == 2 and batch[0, 0].item() == 1:
            raise RuntimeError("pinning failed")
        return batch

    monkeypatch.setattr(module, "pinning_like", lambda loader: pin)
    got = []
    with nostall.prefetch(DataLoader(Shards([6, 6]), batch_size=2), "cpu", threads=2) as p:
        it = iter(p)
        while True:
            try:
                got.append(next(it)[:, :2].tolist())
            except StopIteration:
                break
            except RuntimeError:
                got.append("error")
    assert got == [
        [[0, 0], [0, 1]],
        [[1, 0], [1, 1]],
        [[0, 2], [0, 3]],
        "error",
        [[0, 4], [0, 5]],
        [[1, 4], [1, 5]],
    ]


def test_a_timeout_keeps_the_slow_workers_turn() -> None:
    """After the DataLoader's timeout= the next next() is the slow worker's batch, as torch's."""
    release = threading.Event()

    class Slow(IterableDataset[torch.Tensor]):
        def __iter__(self) -> Iterator[torch.Tensor]:
            worker = torch.utils.data.get_worker_info().id  # type: ignore[union-attr]
            for i in range(4):
                if worker == 1 and i == 2:
                    assert release.wait(60)
                yield torch.tensor([worker, i])

    # Generous: only the batch held back waits it out, even on a loaded machine.
    loader = DataLoader(Slow(), batch_size=2, timeout=2.0)
    got: list[Any] = []
    with nostall.prefetch(loader, "cpu", threads=2) as p:
        it = iter(p)
        while True:
            try:
                got.append(next(it)[:, 1].tolist())
            except StopIteration:
                break
            except RuntimeError as error:
                got.append("timeout" if "timed out" in str(error) else repr(error))
                release.set()
    assert got == [[0, 1], [0, 1], [2, 3], "timeout", [2, 3]]


def test_a_stream_state_at_an_epoch_start_resumes_with_any_reader_count() -> None:
    """Saved after a whole epoch: nothing of the next is skipped, so any count resumes it."""
    dataset = Shards([9, 2, 7, 5])
    with nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu") as p:
        list(p)
        state = p.state_dict()
    assert (1, 0) == (state["epoch"], state["batches_yielded"])
    with nostall.prefetch(DataLoader(dataset, batch_size=2), "cpu", threads=2) as q:
        q.load_state_dict(state)  # not refused
        items = sorted(tuple(row[:2]) for batch in q for row in batch.tolist())
    assert sorted((shard, i) for shard, n in enumerate([9, 2, 7, 5]) for i in range(n)) == items


class StuckOnce(IterableDataset[torch.Tensor]):
    """Worker 1 blocks at its third item while ``block`` is set (until ``release``)."""

    def __init__(self) -> None:
        self.block = True
        self.release = threading.Event()

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        assert info is not None
        for i in range(4):
            if self.block and info.id == 1 and i == 2:
                self.release.wait(60)
            yield torch.tensor([info.id, i])


def test_after_a_worker_stuck_for_good_the_next_epoch_completes() -> None:
    """A timeout, a break, then a whole epoch: the stuck thread no longer holds its place."""
    dataset = StuckOnce()
    p = nostall.prefetch(DataLoader(dataset, batch_size=2, timeout=1.0), "cpu", threads=2)
    try:
        it = iter(p)
        first = [next(it)[:, 1].tolist() for _ in range(3)]
        assert [[0, 1], [0, 1], [2, 3]] == first
        with pytest.raises(RuntimeError, match="timed out after 1 seconds: worker 1"):
            next(it)
        del it  # a break
        dataset.block = False  # the next epoch's worker 1 returns; the old one is still stuck
        second = list(p)
        expected = list(DataLoader(dataset, batch_size=2, num_workers=2))
        assert_same_batches(expected, second)
    finally:
        dataset.release.set()
        p.close()
    assert [] == wait_for_no_nostall_threads(timeout=30.0)
