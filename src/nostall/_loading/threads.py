"""Loading a DataLoader's epoch with threads in this process, instead of worker processes.

``nostall.prefetch(loader, threads=N)`` iterates each epoch of ``loader`` as a
:class:`ThreadedEpoch`: the loader's own index sampler, dataset and ``collate_fn``, its samples
fetched by a pool of N threads. Image decoders, tokenisers, NumPy and most I/O release the GIL,
so the threads load in parallel without a process, a copy of the dataset or pickling per worker.

Invariants:
    * An epoch draws exactly what the loader's own ``iter()`` draws, in the same order: the
      index sampler's iterator, then the workers' base seed from ``loader.generator``. So the
      batches, and the shuffle, are those of iterating the loader itself.
    * Samples are fetched in sampler order (the pool's queue is first in, first out), several
      threads on one batch at once: the first batch arrives after about a batch of work
      divided by N, not after N competing batches.
    * Each sample is fetched with its own random state, seeded from the epoch's base seed and
      the sample's place in the epoch (its batch, and its place in the batch: a resumed epoch
      gives the same seeds): ``torch.thread_safe_generator()`` (and
      ``torch.utils.data.get_worker_info().rng``) give it in the loading threads, and the
      sample's draws through the global entry points (``torch.rand``, ``random.random``,
      ``np.random.rand``, ...) go to it (:mod:`~nostall._loading.own_draws`); a batch's
      ``collate_fn`` draws from a state of its own alike (place ``COLLATE``). So an
      augmentation draws the same values whatever thread loads it and whatever N, runs
      repeat, and the values are not those of ``num_workers=0`` (as a worker process's are
      not). A draw that escapes that routing still reaches the shared global generators:
      while ``inline()`` (a source that may draw from them, see
      :mod:`nostall._sources.global_draws`) the samples are loaded one at a time, in order,
      while the thread that asks for the batch waits (in that thread; under the loader's
      ``timeout=``, each in a loading thread, so that the timeout covers it), so that such
      draws stay in the plain loop's order. On a ``trial()`` (not known yet whether they
      escape) the batch's first sample is fetched that way and judged: it drew from a global
      generator, the rest follow it that way; it did not, the threads fetch the rest (and the
      next batches, N samples in all at most), all of them returned before ``next()``
      returns, so that the pull's own judgement covers them. No generator is ever put back: another
      thread's draws are never drawn again.
    * At most ``room()`` batches beyond the one asked for are started to fill the
      prefetcher's free slots (so that those batches stay within ``depth``). Beyond them,
      the samples of the following batches are started too, ``AHEAD_PER_THREAD * N`` in all
      (the last such batch in part, the rest of it when it is asked for or has room), so
      that N threads fetch while the batch asked for is collated and handed over, and
      whenever N samples are wanted, also with batches smaller than N (``batch_size=1``).
      So what is started and not handed out stays within ``depth`` batches plus
      ``AHEAD_PER_THREAD * N`` samples (while ``inline()``, N samples, only on a trial:
      :meth:`ThreadedEpoch._start_on_trial`).
    * The thread that asks for a batch is woken once it is all loaded (or to check a
      ``timeout=``, an exit, a stuck thread), not once a sample: each wake-up takes the GIL
      from a loading thread.
    * An error of the sampler itself comes after the batches it drew before it, as the
      DataLoader's does, and ends the epoch.
    * The look-ahead never asks the sampler past its ``len()``: asking for the end has effects
      (a ``RandomSampler`` draws once more from the loader's generator), and frameworks that
      take ``len(loader)`` batches (Lightning) never ask for it. Only a ``next()`` that finds
      nothing started asks for more.
    * A sample's error is raised, as the same exception object with a note naming the index
      and the thread, by the ``next()`` of its batch, after every batch before it; the epoch
      goes on with the next batch, as a ``DataLoader``'s does.
    * The loader's ``timeout=`` bounds each wait for a sample of the batch asked for, as a
      ``DataLoader``'s workers bound each batch: the ``RuntimeError`` keeps the batch's turn
      (the next ``next()`` waits for the same batch; a slow sample is not lost), and the sample
      goes on in its thread. A sample that never returns holds its thread until the epoch is
      dropped; the next epoch's samples then take its place (see :class:`Pool`).
    * The samples are fetched by a :class:`~nostall._loading.pool.Pool`, whose threads start when
      work arrives and end when idle; the work of an epoch that is dropped is skipped.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sized
from concurrent.futures import ALL_COMPLETED, Future
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._exceptions import PrefetcherClosedError, add_note
from .._exit import ThreadLetGo
from .._sources.generators import Trial
from .._sources.global_draws import quiet_after_start
from .._stacks import stuck_at
from .._torch_compat import (
    LoadingThreadInfo,
    answer_worker_info_per_thread,
    auto_collation,
    index_sampler,
    pinning_like,
)
from .own_draws import SampleRng, install, routed
from .pool import Pool, SampleFuture

#: Seconds between two looks at a sample that has not returned (its timeout, an exit).
POLL_S = 0.1

#: Seconds a sample waits queued before its waiter asks the pool to free the places that a
#: dropped epoch's samples still hold (see ``Pool.free_dropped``).
STALE_S = 0.5

#: The most loading threads ``threads=`` takes. Threads start per sample in flight (up to N
#: whenever N samples are wanted), so a larger count starts hundreds of threads that share
#: one GIL; past about the cores (more for I/O-bound samples) they only add switching.
#: ``nostall.tune`` tries counts up to this.
MAX_THREADS = 256

#: Samples per loading thread started beyond the batches the prefetcher has room for. While
#: the thread that asked for a batch collates it and hands it over (milliseconds for a batch
#: of images, longer while the loading threads take the cores), each loading thread has these
#: to fetch instead of waiting for the next ask. One left them idle about a tenth of the
#: time on the bench's JPEG batches; two kept them busy (docs/benchmarks.md).
AHEAD_PER_THREAD = 2

#: ``ThreadedEpoch.drawn`` when no batch's indices are drawn and not started.
_NONE: Any = object()


#: ``sample_seed``'s ``within`` for a batch's ``collate_fn`` (a sample's is its place, >= 0).
COLLATE = -1


def sample_seed(base_seed: int, batch: int, within: int) -> int:
    """The seed of sample ``within`` of batch ``batch`` in an epoch of base seed ``base_seed``."""
    mixed = (
        base_seed * 0x9E3779B97F4A7C15 + batch * 0xBF58476D1CE4E5B9 + within * 0x94D049BB133111EB
    )
    mixed &= 2**64 - 1
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


class _Dropped(Exception):
    """A sample not loaded: its epoch was dropped (see :meth:`ThreadedEpoch.let_go`) first."""


class _InStep(SampleFuture):
    """A sample loaded in step under a loader ``timeout=``: submitted when first waited for.

    So the samples of a batch run one at a time, in order (the global generators' draws stay
    the plain loop's), each in a loading thread, where the timeout can bound its wait.
    """

    def __init__(self, index: Any, submit: Callable[[Future[Any]], object]) -> None:
        super().__init__(index)
        self.submit: Callable[[Future[Any]], object] | None = submit

    def start(self) -> None:
        """Submit it (once)."""
        submit, self.submit = self.submit, None
        if submit is not None:
            submit(self)


class _Batch:
    """A batch started and not handed out: its samples' futures, and the trial it was on.

    Invariant: ``unstarted`` is 0 but for the last batch started, which may have been
    started in part for threads that would be idle: its ``futures`` are then those of its
    first ``samples - unstarted`` samples, in their order, and :meth:`ThreadedEpoch._fill`
    submits the rest before any later batch's (the pool's queue stays in sampler order).
    """

    __slots__ = ("futures", "index", "number", "samples", "trial", "unstarted")

    def __init__(self, futures: list[Future[Any]], samples: int, index: Any, number: int) -> None:
        self.futures = futures
        self.samples, self.index, self.number = samples, index, number
        self.trial: Trial | None = None  # the trial it was started on, until awaited
        self.unstarted = 0  # its samples not submitted yet (see the invariant)


class ThreadedEpoch(Iterator[Any]):
    """One epoch of ``loader``, its samples fetched by ``pool`` (see the module's invariants)."""

    def __init__(
        self,
        loader: DataLoader[Any],
        pool: Pool,
        room: Callable[[], int] = lambda: 0,
        first_batch: int = 0,
        *,
        inline: Callable[[], bool] = lambda: False,
        trial: Callable[[], Trial | None] = lambda: None,
    ) -> None:
        """``room()``: batches that may be started ahead; ``first_batch``: the batches skipped.

        ``inline()``: load the samples of the batches started now one at a time in the calling
        thread (a dataset that may draw from the global generators: see
        :mod:`nostall._sources.global_draws`). ``trial()``, asked while ``inline()``: a
        :class:`~nostall._sources.generators.Trial` to fetch them on with the threads instead (not
        known yet whether they draw), or None.
        """
        self.inline, self.trial = inline, trial
        answer_worker_info_per_thread()  # get_worker_info() per loading thread
        install()  # random's and np.random's draws per sample in the loading threads
        self.pool = pool
        self.dataset, self.collate = loader.dataset, loader.collate_fn
        self.pin = pinning_like(loader)  # pin_memory=True: pinned as the loader's would be
        self.auto = auto_collation(loader)
        getitems = getattr(self.dataset, "__getitems__", None)
        self.getitems = getitems if self.auto and callable(getitems) else None
        # What DataLoader.__iter__ draws, in its order: the sampler's iterator, the base seed.
        sampler = index_sampler(loader)
        self.indices = iter(sampler)
        self.base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator))
        self.room = room
        #: The batches started and not handed out: each one's futures and its sample count.
        self.pending: collections.deque[_Batch] = collections.deque()
        #: The sampler draws nothing from the global generators past its start: batches may be
        #: started ahead of the loop on a trial.
        self.quiet_ahead = quiet_after_start(loader)
        #: The next batch's indices, drawn to see whether it fits the threads (``_NONE``: none).
        self.drawn: Any = _NONE
        self.batch = first_batch  # the number in the epoch of the next batch started
        #: Batches in the epoch, when the sampler says (the look-ahead stops there).
        self.length = first_batch + len(sampler) if hasattr(sampler, "__len__") else None
        self.exhausted = False
        #: The loader's own ``timeout`` (seconds a sample may take), as its workers apply it.
        self.timeout = float(loader.timeout) if loader.timeout else None
        #: The sample ``__next__`` waits for now, and what it is; for timeout messages.
        self.waiting: tuple[Future[Any], str] | None = None
        self.dropped = threading.Event()  # the epoch was let go: skip its queued work
        weakref.finalize(self, self.dropped.set)

    def let_go(self) -> None:
        """The epoch is dropped (its puller stopped): its queued samples are skipped."""
        self.dropped.set()

    def __next__(self) -> Any:
        trial = None
        if self.inline() and not self.pending:  # else each pending batch was judged already
            self._peek()  # the sampler's own draws (its order, at its start) come first
            trial = self.trial() if self.timeout is None else None  # see _await_trial
        if not self.pending and not self._start_next(trial):
            raise StopIteration
        if self.pending[0].unstarted:
            self._fill(self.pending[0])  # the batch asked for: every sample, now
        while (
            not self.exhausted
            and len(self.pending) - 1 < self.room()
            and (self.length is None or self.batch < self.length)
        ):
            self._start_next()
        if trial is not None:
            self._start_on_trial(trial)
            self._await_trial(trial)
        else:
            self._start_for_idle_threads()
        started = self.pending[0]
        futures = started.futures
        self._wait_all(futures)  # a timeout raised here keeps the batch's turn
        self.pending.popleft()
        samples = [self._result(f) for f in futures]  # the first failed sample's error, if any
        with routed(SampleRng(sample_seed(self.base_seed, started.number, COLLATE))):
            if self.auto and self.getitems is None:
                batch = self.collate(samples)
            else:
                batch = self.collate(samples[0])  # a batch from __getitems__, or one sample
        return batch if self.pin is None else self.pin(batch)

    def _await_trial(self, trial: Trial) -> None:
        """Wait for every sample started on ``trial`` (see the invariants).

        So that the pull's own judgement, when it returns, covers their draws too. None under
        a loader ``timeout=``: awaiting all, it would raise for another batch.
        """
        for started in [b for b in self.pending if b.trial is trial]:
            for future in started.futures:
                self._wait(future)
            started.trial = None

    def _result(self, future: Future[Any]) -> Any:
        self._wait(future)  # see there
        try:
            return future.result()
        except ThreadLetGo as e:  # its thread was let go (stuck): never this thread's own exit
            raise RuntimeError(f"{getattr(future, 'sample', 'a sample')} was let go") from e
        except _Dropped:
            # Never a batch with a hole in it (collated with None, or a TypeError from the
            # collate): the epoch was stopped by close() or a new iter(), from another thread.
            raise PrefetcherClosedError(
                f"this epoch was stopped (the Prefetcher was closed, or a new iter() began) "
                f"while {getattr(future, 'sample', 'a sample')} of its batch was to load"
            ) from None

    def _wait_all(self, futures: list[Future[Any]]) -> None:
        """Wait for each of ``futures`` in turn, woken once they are all done (see :meth:`_wait`).

        One wake-up of this thread for the batch, not one a sample: each wake-up takes the GIL
        from a loading thread. Samples loaded in step are started and waited for one by one.
        """
        if any(isinstance(f, _InStep) for f in futures):
            for future in futures:
                self._wait(future)
            return
        left = [f for f in futures if not f.done()]
        while left:
            self._wait(left[0], left)
            left = [f for f in left if not f.done()]

    def _wait(self, future: Future[Any], together: list[Future[Any]] | None = None) -> None:
        """Wait for ``future`` in slices (an exit interrupt gets through); start it if in step.

        ``together``: futures (``future`` among them) whose completion ends a slice early only
        when all are done; without them, ``future``'s alone.

        Raises:
            RuntimeError: the loader's ``timeout`` passed first, as a DataLoader's workers
                raise it; the sample is named, and goes on loading (see the invariants).
        """
        if isinstance(future, _InStep):
            future.start()
        if not future.done():
            start = time.monotonic()
            self.waiting = (future, getattr(future, "sample", "a sample"))
            watched = [future] if together is None else together
            try:
                while futures_wait(watched, POLL_S, ALL_COMPLETED).not_done and not future.done():
                    if not future.running() and time.monotonic() - start >= STALE_S:
                        self.pool.free_dropped()  # behind a dropped epoch's stuck sample?
                    if self.timeout is not None and time.monotonic() - start >= self.timeout:
                        raise RuntimeError(
                            f"DataLoader timed out after {self.timeout:g} seconds: "
                            f"{self.waiting_on()} has not returned (the DataLoader's "
                            f"timeout=, applied to each sample by nostall's loading threads)"
                        )
            finally:
                self.waiting = None

    def waiting_on(self) -> str:
        """What ``__next__`` waits for now: the sample, its thread and line; '' if nothing."""
        waiting = self.waiting
        if waiting is None:
            return ""
        future, sample = waiting
        running = self.pool.running.get(future)
        if running is None:
            busy = "every loading thread is busy" if self.pool.live else "no loading thread runs"
            return f"{sample} (not started: {busy})"
        thread = running[0]
        line = stuck_at(thread).line
        return f"{sample} in {thread.name!r}" + (f" at {line}" if line else "")

    def _start_on_trial(self, trial: Trial) -> None:
        """Start the batches after the one asked for on ``trial``, N samples in all at most.

        So that N threads fetch at once from the first batch on (``batch_size=1`` too). Counted,
        not timed (unlike :meth:`_start_for_idle_threads`): the trial waits for all its samples,
        which must be able to finish together whatever the timing. Only once the trial was
        judged clear, and after a sampler that draws nothing past its start
        (:func:`~nostall._sources.global_draws.quiet_after_start`).
        """
        if not self.quiet_ahead or trial.drew is None or trial.drew:
            return  # drew: in step for good; None: started nothing (the sampler's error)
        spare = self.pool.size - sum(b.samples for b in self.pending)  # the batch asked for
        while spare > 0 and (self.length is None or self.batch < self.length):
            index = self._peek()
            samples = self._samples(index)
            if index is _NONE or samples > spare:
                return  # the end, the sampler's error (queued), or a batch too big to fit
            self._start_next(trial)
            spare -= samples

    def _start_for_idle_threads(self) -> None:
        """Start samples after the room's batches, for threads that would otherwise idle.

        N is ``pool.size``. Without them, the threads would wait from the last sample of the
        batch asked for until the next ``next()`` (the collate, the hand-over, the loop's turn:
        milliseconds a batch); with them, ``AHEAD_PER_THREAD * N`` samples of the following
        batches are queued behind: with ``batch_size=1`` and ``depth=2``, N = 6 threads fetch
        6 samples at once, not ``depth + 1``; with batches larger than that, the next batch
        is started in part (:class:`_Batch`). Never past the sampler's ``len()``, nor while
        the samples are loaded in step (``inline()``: they would be loaded now, in this
        thread, ahead of the loop's own draws; a trial starts its own:
        :meth:`_start_on_trial`).
        """
        if self.inline():
            return
        room = self.room()
        last = self.pending[-1] if self.pending else None
        if last is not None and last.unstarted and len(self.pending) - 1 <= room:
            self._fill(last)  # within the room's batches now: whole
        beyond = itertools.islice(self.pending, room + 1, None)
        spare = AHEAD_PER_THREAD * self.pool.size - sum(b.samples - b.unstarted for b in beyond)
        if last is not None and last.unstarted and spare > 0:
            spare -= self._fill(last, spare)
        while spare > 0 and (self.length is None or self.batch < self.length):
            index = self._peek()
            if index is _NONE:
                return  # the end, or the sampler's error (queued)
            samples = self._samples(index)
            if samples > spare and not self._divisible():
                return  # one fetch for the whole batch (__getitems__): it waits its turn
            self._start_next(part=spare)
            spare -= min(samples, spare)

    def _divisible(self) -> bool:
        """A batch's samples are fetched one by one (so a batch may be started in part)."""
        return self.auto and self.getitems is None

    def _fill(self, batch: _Batch, most: int | None = None) -> int:
        """Submit the next of ``batch``'s samples not submitted yet (``most`` at most).

        Returns how many were submitted. ``batch`` is the last one started (see :class:`_Batch`).
        """
        start = batch.samples - batch.unstarted
        stop = batch.samples if most is None else min(batch.samples, start + most)
        fetch = self.dataset.__getitem__
        for k in range(start, stop):
            batch.futures.append(self._submit(fetch, batch.index[k], batch.number, k, False))
        batch.unstarted = batch.samples - stop
        return stop - start

    def _samples(self, index: Any) -> int:
        """The samples in the batch of ``index`` (more than any pool when it cannot tell)."""
        if not self.auto:
            return 1
        return len(index) if isinstance(index, Sized) else MAX_THREADS + 1

    def _peek(self) -> Any:
        """The next batch's indices, drawn once and kept until it starts; ``_NONE`` at the end.

        The sampler's own error is queued in its place as a failed batch (holding no sample),
        and ends the epoch, as the DataLoader's does.
        """
        if self.drawn is not _NONE or self.exhausted:
            return self.drawn
        try:
            index = next(self.indices)
            if self.auto and self.getitems is None and not isinstance(index, Sized):
                index = list(index)  # fetched one by one anyway: counted, then iterated
            self.drawn = index
        except StopIteration:
            self.exhausted = True
        except Exception as e:  # the sampler's own error: in its place, and the epoch ends
            self.exhausted = True
            failed: Future[Any] = Future()
            failed.set_exception(e)
            self.pending.append(_Batch([failed], 0, None, self.batch))
        return self.drawn

    def _start_next(self, trial: Trial | None = None, *, part: int | None = None) -> bool:
        """Queue the next batch's samples (on ``trial``, if any); False at the sampler's end.

        ``part``: at most that many of its samples, the rest left to :meth:`_fill` (only
        where :meth:`_divisible`, not on a trial, not in step). A batch started in part
        before is filled first: the pool's queue stays in sampler order.
        """
        if self.pending and self.pending[-1].unstarted:
            self._fill(self.pending[-1])
        before = len(self.pending)
        index = self._peek()
        if index is _NONE:
            return len(self.pending) > before  # the sampler's error, queued in its place
        self.drawn = _NONE
        batch, self.batch = self.batch, self.batch + 1
        here = trial is None and self.inline()
        samples = self._samples(index)
        if part is not None and part < samples and trial is None and not here and self._divisible():
            started = _Batch([], samples, list(index), batch)
            started.unstarted = samples
            self.pending.append(started)
            self._fill(started, part)
            return True
        futures = self._submit_batch(index, batch, here, trial)
        started = _Batch(futures, samples, index, batch)
        started.trial = trial
        self.pending.append(started)
        return True

    def _submit_batch(
        self, index: Any, batch: int, here: bool, trial: Trial | None = None
    ) -> list[Future[Any]]:
        """The futures of batch number ``batch``'s samples (``here``: fetched in this thread).

        On a ``trial`` not judged yet, the first sample is fetched in this thread, then the
        trial is judged: drew, the others are fetched here too, in order; else by the threads.
        """
        judge = trial is not None and trial.drew is None
        if self.getitems is not None or not self.auto:
            fetch = self.getitems if self.getitems is not None else self.dataset.__getitem__
            future = self._submit(fetch, index, batch, 0, here or judge)
            if trial is not None:
                trial.judge()
            return [future]
        futures = []
        for k, i in enumerate(index):
            futures.append(self._submit(self.dataset.__getitem__, i, batch, k, here or judge))
            if judge and trial is not None:
                judge, here = False, bool(trial.judge())  # drew: the rest after it, here
        return futures

    def _submit(
        self, fetch: Callable[[Any], Any], index: Any, batch: int, within: int, here: bool
    ) -> Future[Any]:
        seed = sample_seed(self.base_seed, batch, within)
        dataset, dropped, size = self.dataset, self.dropped, self.pool.size

        def task(worker: int) -> Any:
            if dropped.is_set():
                raise _Dropped  # nobody should take it; one who does learns why (_result)
            rng = SampleRng(seed)
            with (
                LoadingThreadInfo(worker=worker, workers=size, seed=seed, dataset=dataset, rng=rng),
                routed(rng),  # its global draws too: see the invariants
            ):
                try:
                    return fetch(index)
                except BaseException as e:
                    thread = threading.current_thread().name
                    add_note(e, f"nostall: raised by dataset[{index!r}] in {thread!r}")
                    raise

        if here and self.timeout is not None:
            pool = self.pool  # not self: the futures must not keep the epoch alive
            return _InStep(index, lambda future: pool.submit(task, future, dropped=dropped))
        if here:
            done: Future[Any] = SampleFuture(index)
            try:
                done.set_result(task(0))
            except BaseException as e:
                done.set_exception(e)
            return done
        return self.pool.submit(task, SampleFuture(index), dropped=dropped)
