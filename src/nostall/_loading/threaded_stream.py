"""``threads=N`` over an ``IterableDataset``: N loading threads iterate it as N workers would.

A DataLoader with ``num_workers=N`` over an ``IterableDataset`` gives each worker process its
own iterator of the dataset (``get_worker_info()`` tells the dataset which worker of how many
it is, so that a dataset reading shards gives each worker its own), batches each worker's items
in that worker, and yields the workers' batches in turn: worker 0's first batch, worker 1's
first, ..., worker 0's second, skipping a worker once its iterator ended. A
:class:`ThreadedStream` does the same with N threads of this process.

Invariants:
    * The batches, and their order, are those of the loader built with ``num_workers=N``:
      worker w's iterator is made with ``get_worker_info()`` answering ``id=w,
      num_workers=N`` in the thread that advances it, its items batched as torch's fetcher
      batches them (``batch_size`` items, a shorter last batch unless ``drop_last``, each
      batch collated by the loader's ``collate_fn``), and the workers take turns in order.
    * An epoch draws from the global generator what the loader's ``iter()`` draws: its base
      seed, from ``loader.generator``. Worker w's generators (``torch.thread_safe_generator()``,
      ``get_worker_info().rng``) are seeded ``base_seed + w``, as torch seeds worker w, and
      its global draws (torch's, ``random``'s and ``np.random``'s entry points: see
      :mod:`~nostall._loading.own_draws`) go to them, its collate's too: torch's and
      ``random``'s draws are those of worker process w, which seeds them so.
    * Each worker's iterator is made and advanced in one thread, its own, for the whole
      epoch (as in a worker process), so that a handle opened in ``__iter__`` (a database
      connection, a file) stays in the thread that opened it.
    * While ``inline()`` at the epoch's first batch (a dataset that may draw from the global
      generators, see :mod:`nostall._sources.global_draws`), the workers go **in step**: the
      consumer lets one worker make one batch and waits for it, in turn, so that such draws
      keep the plain loop's order; once ``inline()`` is False they run freely.
    * Batches are collated outside the worker's ``get_worker_info()``, as a map-style epoch's
      are: ``default_collate`` would put a batch made in a worker into shared memory (a file
      descriptor each), which a thread does not need.
    * Each worker's thread keeps at most one finished batch waiting (and one being made): what
      the epoch holds ahead is at most 2N batches.
    * An error in a worker's iterator is raised at that worker's turn, as the same exception
      object with a note naming the worker and the thread; the epoch goes on with the next
      worker's turn, and the worker that raised is asked again at its next turn (a generator
      that raised has ended: its turn then ends it), as a DataLoader's worker is.
    * Dropping the epoch (``break``, ``close()``, a newer ``iter()``: :meth:`let_go`, or
      garbage collection) stops each thread at its next batch; one inside the dataset's
      ``__next__`` ends when that returns, or is interrupted there once a later epoch's
      worker has waited :data:`STALE_S` for its place (``Pool.free_dropped``).
    * A dataset that makes a batch without asking ``get_worker_info()`` would be read whole
      by every thread (every item N times, as by N worker processes): the epoch raises
      :class:`NotSplitError` instead, with the fix.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._exceptions import add_note
from .._exit import ThreadLetGo
from .._torch_compat import (
    LoadingThreadInfo,
    answer_worker_info_per_thread,
    auto_collation,
    index_sampler,
    pinning_like,
    worker_info_asked,
)
from .own_draws import SampleRng, install, routed
from .pool import Pool
from .threads import POLL_S, STALE_S


class NotSplitError(ValueError):
    """An ``IterableDataset`` that never asked which worker it is, read by N threads."""

    def __init__(self, dataset: object, workers: int) -> None:
        name = type(dataset).__qualname__
        super().__init__(
            f"nostall.prefetch(threads={workers}): {name} made a batch without asking "
            f"torch.utils.data.get_worker_info() which worker it is, so each of the "
            f"{workers} loading threads would read all of it: every item {workers} times "
            f"(as with num_workers={workers}). Split its items by get_worker_info().id and "
            f".num_workers in __iter__ (as for worker processes), or leave threads out"
        )


class _Turn(enum.Enum):
    BATCH = "batch"
    ERROR = "error"
    END = "end"


class _Worker:
    """Worker w's iterator of the dataset, advanced in whichever one thread holds ``lock``."""

    def __init__(self, index: int, seed: int) -> None:
        self.index, self.seed = index, seed
        self.rng = SampleRng(seed)
        self.iterator: Iterator[Any] | None = None
        #: The iterator raised StopIteration (inside a short last batch): its next turn ends.
        self.exhausted = False
        #: Its end was made: the consumer skips its turns once it took what is ready.
        self.ended = False
        self.lock = threading.Lock()
        #: The dataset asked ``get_worker_info()`` while this worker's batches were made.
        self.asked = False
        #: Batches the worker's thread made and the consumer has not taken (at most one).
        self.ready: queue.Queue[tuple[_Turn, Any]] = queue.Queue(maxsize=1)
        self.thread: Future[Any] | None = None
        #: In step: the thread makes a batch only when granted one (``go``).
        self.stepped = False
        self.go = threading.Semaphore(0)
        #: A grant not yet used for a batch the consumer took (set and read by the consumer).
        self.granted = False


class ThreadedStream(Iterator[Any]):
    """One epoch of ``loader`` (over an ``IterableDataset``) read by ``pool``'s N threads."""

    def __init__(
        self,
        loader: DataLoader[Any],
        pool: Pool,
        *,
        inline: Callable[[], bool] = lambda: False,
    ) -> None:
        answer_worker_info_per_thread()
        install()  # random's and np.random's draws per worker in the loading threads
        self.pool, self.inline = pool, inline
        self.fetcher = _Fetcher(loader, pool.size)
        # What DataLoader.__iter__ draws, in its order: the sampler's iterator (an infinite
        # constant sampler here: nothing), then the workers' base seed.
        iter(index_sampler(loader))
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator))
        self.workers = [_Worker(w, base_seed + w) for w in range(pool.size)]
        self.turn = 0  # the worker whose batch comes next
        #: The loader's own ``timeout`` (seconds a batch may take), as its workers apply it.
        self.timeout = float(loader.timeout) if loader.timeout else None
        self.started = False
        self.stepped = False  # the workers go in step (see the invariants)
        self.dropped = threading.Event()  # the epoch was let go: the threads stop
        weakref.finalize(self, self.dropped.set)

    def __next__(self) -> Any:
        while True:
            live = [w for w in self.workers if not w.ended or not w.ready.empty()]
            if not live:
                raise StopIteration
            worker = self.workers[self.turn]
            if worker.ended and worker.ready.empty():
                self._next_turn()
                continue  # its iterator ended at an earlier turn: skipped, as torch skips it
            if not self.started:
                self._start(stepped=self.inline())
            elif self.stepped and not self.inline():
                self._free()
            if self.stepped and not worker.granted:
                worker.go.release()
                worker.granted = True
            kind, payload = self._take(worker)  # a timeout raised here keeps the turn
            worker.granted = False
            self._next_turn()
            if kind is _Turn.END:
                continue
            if kind is _Turn.ERROR:
                if isinstance(payload, NotSplitError):
                    self.let_go()  # every thread would read every item: the epoch ends
                    for each in self.workers:
                        each.ended = True
                raise payload
            return payload

    def _next_turn(self) -> None:
        self.turn = (self.turn + 1) % len(self.workers)

    def let_go(self) -> None:
        """The epoch is dropped (its puller stopped): the threads end at their next batch.

        Also reached through the finaliser when the stream is collected; called explicitly,
        since an exception the loop keeps holds frames that hold the stream.
        """
        self.dropped.set()

    def _start(self, *, stepped: bool) -> None:
        """Start one long task per worker on the pool, in step or free (once per epoch)."""
        self.started, self.stepped = True, stepped
        fetch, dropped = self.fetcher.fetch, self.dropped  # not self: see _Fetcher
        for worker in self.workers:
            worker.stepped = stepped
            if not worker.ended:
                worker.thread = self.pool.submit(_task(fetch, worker, dropped), dropped=dropped)

    def _free(self) -> None:
        """The workers leave the step and run freely (once): each waiting one is woken."""
        self.stepped = False
        for worker in self.workers:
            worker.stepped = False
            worker.go.release()

    def _take(self, worker: _Worker) -> tuple[_Turn, Any]:
        """Worker ``worker``'s next message, waited for in slices (an exit interrupt gets in)."""
        start = time.monotonic()
        while True:
            try:
                return worker.ready.get(timeout=POLL_S)
            except queue.Empty:
                pass
            thread = worker.thread
            queued = thread is not None and not thread.running() and not thread.done()
            if queued and time.monotonic() - start >= STALE_S:
                self.pool.free_dropped()  # behind a dropped epoch's stuck worker?
            if thread is not None and thread.done() and worker.ready.empty():
                error = thread.exception()
                if error is None:  # ended without a last message: only when dropped
                    worker.ended = True
                    return _Turn.END, None
                worker.ended = True
                return _Turn.ERROR, error
            if self.timeout is not None and time.monotonic() - start >= self.timeout:
                raise RuntimeError(
                    f"DataLoader timed out after {self.timeout:g} seconds: worker "
                    f"{worker.index}'s next batch has not come (the DataLoader's timeout=, "
                    f"applied to each batch by nostall's loading threads)"
                )


_END: Any = object()


class _Fetcher:
    """Makes a worker's batches as torch's iterable-dataset fetcher does; holds no stream.

    The threads' tasks hold this and their worker, never the :class:`ThreadedStream`, so that
    dropping the stream lets its finaliser stop them.
    """

    def __init__(self, loader: DataLoader[Any], workers: int) -> None:
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.batch_size = loader.batch_size if auto_collation(loader) else None
        self.drop_last = loader.drop_last
        self.pin = pinning_like(loader)
        self.workers = workers

    def fetch(self, worker: _Worker) -> tuple[_Turn, Any]:
        """Make worker ``worker``'s next batch in this thread, as torch's fetcher makes it."""
        with worker.lock:
            if worker.ended or worker.exhausted:
                worker.ended = True
                return _Turn.END, None
            try:
                try:
                    with (
                        LoadingThreadInfo(
                            worker=worker.index,
                            workers=self.workers,
                            seed=worker.seed,
                            dataset=self.dataset,
                            rng=worker.rng,
                        ),
                        routed(worker.rng),
                    ):
                        if worker.iterator is None:
                            worker.iterator = iter(self.dataset)
                        batch = self.next_items(worker, worker.iterator)
                finally:
                    # What the dataset asked before it raised counts too: a worker whose first
                    # batch raises, after its __iter__ asked which worker it is, has split.
                    worker.asked = worker.asked or worker_info_asked()
                if batch is _END:
                    worker.ended = True
                    return _Turn.END, None
                if not worker.asked and self.workers > 1:
                    return _Turn.ERROR, NotSplitError(self.dataset, self.workers)
                with routed(worker.rng):  # the worker's draws, in its order, as in a process
                    batch = self.collate(batch)  # outside the worker's info: see the invariants
                if self.pin is not None:
                    batch = self.pin(batch)
            except ThreadLetGo:
                raise
            except Exception as e:
                add_note(
                    e,
                    f"nostall: raised by the dataset's iterator in worker {worker.index} of "
                    f"{self.workers}, in {threading.current_thread().name!r}",
                )
                return _Turn.ERROR, e
            return _Turn.BATCH, batch

    def next_items(self, worker: _Worker, items: Iterator[Any]) -> Any:
        """The next batch's items (one item unbatched), not collated; ``_END`` at the end."""
        if self.batch_size is None:
            try:
                return next(items)
            except StopIteration:
                return _END
        batch = []
        for _ in range(self.batch_size):
            try:
                batch.append(next(items))
            except StopIteration:
                worker.exhausted = True  # the next turn ends it, after this short batch
                break
        if not batch or (self.drop_last and len(batch) < self.batch_size):
            return _END
        return batch


def _run(
    fetch: Callable[[_Worker], tuple[_Turn, Any]], worker: _Worker, dropped: threading.Event
) -> None:
    """A worker's thread: make its batches in turn until its iterator ends or it is dropped."""
    while not dropped.is_set():
        if worker.stepped:
            if not worker.go.acquire(timeout=POLL_S):
                continue  # not granted yet: dropped is looked at again
            if dropped.is_set():
                return  # granted, then let go: no batch of a dropped epoch is made
        try:
            message = fetch(worker)
        except Exception as e:  # outside the dataset (its worker info, say): at its turn
            message = (_Turn.ERROR, e)
        while True:
            try:
                worker.ready.put(message, timeout=POLL_S)
                break
            except queue.Full:
                if dropped.is_set():
                    return
        if message[0] is _Turn.END:
            return


def _task(
    fetch: Callable[[_Worker], tuple[_Turn, Any]], worker: _Worker, dropped: threading.Event
) -> Callable[[int], None]:
    """The pool task of ``worker``'s thread (see :func:`_run`)."""
    return lambda _thread_id: _run(fetch, worker, dropped)
