"""Whether a DataLoader's samples come out the same when threads load them at once.

``threads=`` calls the dataset's ``__getitem__`` from several threads at a time. A dataset
that is not safe for that (one file object shared by a seek and a read, a decoder handle,
a cache filled without a lock) gives wrong samples, or raises, only under threads. ``tune``
and the doctor must not recommend threads for it, so before trying threads they load the
first samples (at most :data:`MAX_SAMPLES`), batched and collated as the loader does:

1. twice with ``threads=1`` from the same loader (each sample its own random state, as
   ``threads=`` gives, its draws from the global entry points routed to it: see
   :mod:`nostall._loading.own_draws`), the global generators (torch's, Python's ``random``,
   NumPy's) watched: a dataset or collate_fn that still draws from them, or whose samples
   differ between the
   two loads (a generator of its own), cannot be checked (``random``): a difference under
   threads would not say whether threads caused it. If one loading thread alone raises, the
   samples are loaded once more in the calling thread, as the plain loop loads them: loaded
   there, the dataset works only in the thread that built it (``raised``, ``thread_bound``:
   an sqlite3 connection made in ``__init__``, say); raising there too, it is broken in
   itself (``failed``: the trials show its error);
2. with ``threads=N``, each pass from a loader freshly built (its caches empty, so that
   filling them races too), the global generators put back first, each call started at once
   with the other threads' (a barrier) and the interpreter switching threads every few
   microseconds: at least :data:`MIN_PASSES` passes, more while within :data:`BUDGET_S`
   (a cheap dataset gets many chances). A sample that differs from the one-thread load
   (``differed``), or an error that one thread did not meet (``raised``), says the dataset is
   not thread-safe; if all agree, nothing was seen (``agreed``).

A race that did not happen in these loads is not seen: ``agreed`` is evidence, not proof.
Only ``differed`` and ``raised`` keep threads from being tried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, Dataset

from .._prefetcher import prefetch
from .._sources.generators import Snapshot, moved, snapshot
from .._sources.global_draws import unwatched
from .._thread_bound import FIX
from .._torch_compat import auto_collation

#: The most samples the check loads per pass (four passes; one kept).
MAX_SAMPLES = 64
#: The interpreter's thread switch interval during the threaded passes (default 5 ms).
SWITCH_S = 1e-6
#: The threaded passes: at least MIN_PASSES, then more while within BUDGET_S, up to MAX_PASSES.
#: Each pass is another chance for a race to show; a cheap dataset gets many.
MIN_PASSES, MAX_PASSES, BUDGET_S = 2, 32, 1.0
#: How long a call waits for the other threads' before it goes on alone.
BARRIER_S = 0.05
#: The longest a pass waits for one batch: a dataset that deadlocks under threads fails.
TIMEOUT_S = 120.0

Verdict = Literal["agreed", "differed", "raised", "random", "failed"]


@dataclass(frozen=True)
class ThreadSafety:
    """The outcome of :func:`check_thread_safety` for ``threads`` threads over ``samples``."""

    verdict: Verdict
    threads: int
    samples: int
    #: For "differed": the first and last sample index of the first sample (or collated batch)
    #: that differed from the one-thread load.
    differed: tuple[int, int] | None = None
    #: What was raised ("raised"), or why the check could not decide ("random", "failed").
    why: str = ""
    #: For "agreed": how many times the threads loaded the samples.
    passes: int = 0
    #: For "random": the global generators the one-thread load drew from (``tune`` does not
    #: try threads then: they would change the draws, see :mod:`nostall._sources.global_draws`).
    drew: tuple[str, ...] = ()
    #: For "raised": one loading thread alone raised, where the calling thread loaded the same
    #: samples: the dataset works only in the thread that built it (not a race between threads).
    thread_bound: bool = False

    @property
    def unsafe(self) -> bool:
        """Whether threads gave other samples, or errors, than one thread: never recommend."""
        return self.verdict in ("differed", "raised")

    def describe(self) -> str:
        """One line, as the doctor prints it."""
        n = self.threads
        if self.verdict == "agreed":
            return (
                f"thread safety: {n} threads, starting their calls together, loaded the same "
                f"{self.samples} samples as one thread, {self.passes} times over (a check, "
                f"not a proof: a rare race can still escape it)."
            )
        if self.thread_bound:
            return (
                f"thread safety: NOT loadable by threads: one loading thread alone raised "
                f"{self.why.rstrip('.')}, where this thread loaded the same samples, so threads "
                f"were not tried. The dataset holds something that works only in the thread "
                f"that built it (an sqlite3 connection made in __init__, say). To load it with "
                f"threads, {FIX}."
            )
        if self.unsafe:
            if self.differed is not None:
                first, last = self.differed
                which = (
                    f"dataset[{first}]"
                    if first == last
                    else f"the batch of dataset[{first}] to dataset[{last}]"
                )
                what = f"{which} came out other than one thread loaded it"
            else:
                what = f"loading raised {self.why}, where one thread loaded the samples"
            return (
                f"thread safety: NOT thread-safe: with {n} threads at once, {what}, so threads "
                f"were not tried. Its __getitem__ shares something between calls (a file "
                f"position used by seek then read, a decoder, a cache): read with os.pread, or "
                f"open each handle on first use in each thread (threading.local()); worker "
                f"processes share a file opened before they start, too."
            )
        if self.drew:
            return (
                f"thread safety: not checked, and threads not tried: the dataset or collate_fn "
                f"draws from {' and '.join(self.drew)}, which loading threads share, so they "
                f"would change the draws your model sees (nostall.prefetch(threads=...) loads "
                f"such a dataset one sample at a time). Draw from torch.thread_safe_generator() "
                f"to load it with threads: each sample then gets its own generator."
            )
        return f"thread safety: not checked: {self.why}."


def check_thread_safety(build: Callable[[], DataLoader[Any]], threads: int) -> ThreadSafety:
    """Load the first samples of fresh loaders from ``build`` with one thread, then ``threads``.

    See the module docstring. The samples are batched and collated as the loader does, at most
    :data:`MAX_SAMPLES` of them in at least two batches. Never raises for the dataset's errors:
    an error with one loading thread makes a "raised" check where the calling thread loads the
    samples, else a "failed" one (the trials show the error itself).
    """
    loader = build()
    try:
        count = min(len(loader.dataset), MAX_SAMPLES)  # type: ignore[arg-type]
    except TypeError:
        return ThreadSafety("failed", threads, 0, why="the dataset has no len()")
    batch_size = (loader.batch_size or 8) if auto_collation(loader) else None
    if batch_size is not None:
        batch_size = max(1, min(batch_size, math.ceil(count / 2)))  # two batches at least

    def checking(source: DataLoader[Any], dataset: Any) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=range(count),
            collate_fn=source.collate_fn,
            # The samples' random states come from this generator's first draw (the epoch's
            # base seed), the same in every pass, and not from the global generator.
            generator=torch.Generator().manual_seed(0),
        )

    def load(threads: int, fresh: bool = True) -> Generator[Any, None, None]:
        source = build() if fresh else loader  # a fresh dataset: its caches empty
        dataset = source.dataset if threads == 1 else _in_step(source.dataset, threads)
        check = checking(source, dataset)
        # Deep enough that every thread has a sample to load, one sample per batch too.
        depth = max(2, 2 * threads)
        with prefetch(check, "cpu", threads=threads, depth=depth, timeout=TIMEOUT_S) as batches:
            yield from batches

    def load_here() -> Iterator[Any]:
        source = build()  # built in this thread, and loaded in it: no nostall thread
        return iter(checking(source, source.dataset))

    with unwatched():  # each load judges the global generators itself
        return _check(
            load,
            reference_loads=lambda: load(1, fresh=False),
            threads=threads,
            count=count,
            batch_size=batch_size,
            loads_here=load_here,
        )


def _check(
    load: Callable[[int], Generator[Any, None, None]],
    reference_loads: Callable[[], Generator[Any, None, None]],
    threads: int,
    count: int,
    batch_size: int | None,
    loads_here: Callable[[], Iterator[Any]],
) -> ThreadSafety:
    """:func:`check_thread_safety` once its loads are set up.

    ``loads_here()`` loads the samples in the calling thread, without a loading thread.
    """

    def inconclusive(why: str, drew: tuple[str, ...] = ()) -> ThreadSafety:
        return ThreadSafety("random", threads, count, why=why, drew=drew)

    try:
        with _global_generators() as drawn:
            reference = list(reference_loads())
        if drawn():
            return inconclusive(
                "the dataset or collate_fn draws from a global random generator (torch's, "
                "random's or NumPy's) in a way that nostall's loading threads cannot give "
                "each sample a generator of its own for (a torch function that takes no "
                "generator=, a function bound before nostall started, the generator object "
                "itself), and threads share it; draw from torch.thread_safe_generator() to "
                "make its samples reproducible with threads, and checkable",
                drawn(),
            )
        # The same dataset object again: a generator of its own has moved on meanwhile.
        with _global_generators(), contextlib.closing(reference_loads()) as again:
            if _first_difference(reference, again) is not None:
                return inconclusive(
                    "two one-thread loads of the same samples differed (a generator of the "
                    "dataset's own, or samples that cannot be compared)"
                )
    except Exception as e:
        if _loads(loads_here):  # only a loading thread raises: bound to the building thread
            why = f"{type(e).__name__}: {e}"[:200]
            return ThreadSafety("raised", threads, count, why=why, thread_bound=True)
        return ThreadSafety("failed", threads, count, why=f"loading raised {type(e).__name__}")
    deadline = time.monotonic() + BUDGET_S
    passes = 0
    while passes < MIN_PASSES or (passes < MAX_PASSES and time.monotonic() < deadline):
        passes += 1
        try:
            with (
                _global_generators(),
                _switching_often(),
                contextlib.closing(load(threads)) as loaded,
            ):
                item = _first_difference(reference, loaded)
        except Exception as e:  # one thread loaded these samples without it
            return ThreadSafety("raised", threads, count, why=f"{type(e).__name__}: {e}"[:200])
        if item is not None:
            size = batch_size or 1
            first = item * size
            where = (first, min(first + size, count) - 1)
            return ThreadSafety("differed", threads, count, differed=where)
    return ThreadSafety("agreed", threads, count, passes=passes)


def _loads(loads: Callable[[], Iterator[Any]]) -> bool:
    """Whether ``loads()`` runs through without an error (the global generators put back)."""
    try:
        with _global_generators():
            for _ in loads():
                pass
    except Exception:
        return False
    return True


class _InStep(Dataset[Any]):
    """The dataset, each call started at once with the other threads' (a barrier of N).

    A race needs two calls inside the same steps at the same time; calls that start together
    (after the same wait for I/O, say) meet there far more often than calls that drift.
    When fewer calls come than threads (an epoch's end), the barrier gives up after a while.
    """

    def __init__(self, dataset: Any, threads: int) -> None:
        self.dataset = dataset
        self.barrier = threading.Barrier(threads)

    def __len__(self) -> int:
        return len(self.dataset)

    def _together(self) -> None:
        try:
            self.barrier.wait(timeout=BARRIER_S)
        except threading.BrokenBarrierError:
            self.barrier.reset()  # some thread came alone: go on, and meet again later

    def __getitem__(self, index: Any) -> Any:
        self._together()
        return self.dataset[index]


class _InStepItems(_InStep):
    """:class:`_InStep` for a dataset that fetches a batch at once (``__getitems__``)."""

    def __getitems__(self, indices: Any) -> Any:
        self._together()
        return self.dataset.__getitems__(indices)


def _in_step(dataset: Any, threads: int) -> _InStep:
    getitems = callable(getattr(dataset, "__getitems__", None))
    return (_InStepItems if getitems else _InStep)(dataset, threads)


@contextmanager
def _switching_often() -> Iterator[None]:
    """Threads switch every few microseconds meanwhile, not every 5 ms.

    A race in Python code needs a switch between two of its steps (a seek and its read): the
    shorter the interval, the more often the threads interleave there.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextmanager
def _global_generators() -> Iterator[Callable[[], tuple[str, ...]]]:
    """Put the global generators back afterwards; yield a function: which moved meanwhile?"""
    numpy: Any = sys.modules.get("numpy")  # a dataset that uses it imported it already
    states = (torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state())
    before = snapshot()
    after: list[Snapshot] = []

    def drawn() -> tuple[str, ...]:
        return moved(before, after[0])

    try:
        yield drawn
    finally:
        after.append(snapshot())
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(states[2])


def _first_difference(reference: list[Any], loaded: Iterator[Any]) -> int | None:
    """The position of the first item (a sample, or a collated batch) that differs, or None.

    ``loaded`` is compared as it comes and left at the first difference.
    """
    count = 0
    for i, item in enumerate(loaded):
        if i >= len(reference) or not _same(reference[i], item):
            return i
        count += 1
    return None if count == len(reference) else count


def _same(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN; objects by their attributes.

    What cannot be compared counts as equal: the check then sees nothing, rather than a race
    that is not there.
    """
    try:
        return _compare(a, b)
    except Exception:
        return True


def _compare(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    numpy = sys.modules.get("numpy")
    if numpy is not None and (isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray)):
        nan = getattr(a, "dtype", None) is not None and a.dtype.kind in "fc"
        return bool(numpy.array_equal(a, b, equal_nan=nan))
    # A dataclass compares its fields as a tuple (ambiguous for tensors); an object without
    # __eq__ compares by identity, never equal across loads: compare their attributes.
    by_identity = getattr(type(a), "__eq__", None) is getattr(object, "__eq__", None)
    if (
        type(a) is type(b)
        and hasattr(a, "__dict__")
        and (dataclasses.is_dataclass(a) or by_identity)
    ):
        return _same(vars(a), vars(b))
    return bool(a == b) or (a != a and b != b)  # NaN
