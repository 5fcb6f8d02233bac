"""The GIL convoy: what a hand-off costs when both threads make GIL-free calls, as on a GPU.

Every CUDA call torch makes (``pin_memory``, ``.to``, an event's ``record``, each kernel launch
of the step) releases the GIL for a few microseconds. With a loading thread and a training
thread both doing so, each release lets the other thread in, and taking the GIL back waits for
that thread's next release: a thread hand-over of the GIL, microseconds each. The simulated
CUDA of the tests holds the GIL in its calls and cannot show this; this benchmark can, on any
machine: the source and the step each make ``k`` calls per batch into C that busy-wait for
their share of ``source_us`` and ``step_us`` with the GIL released (through :mod:`ctypes`, as
torch's bindings release it), and the loop's time per batch is compared with the ideal overlap
(``max(source_us, step_us)``), the serial loop and the usual prefetchers, alternating.

The busy-wait is a C function compiled once with the system's C compiler; without one, a
``memset`` of a calibrated length (libc, also GIL-free) stands in, and the report says which.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import importlib.util
import os
import queue
import resource
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .._prefetcher import prefetch

_SPIN_C = b"""
#include <time.h>
static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
void nostall_spin_us(double us) {
    double end = now_us() + us;
    while (now_us() < end) {
    }
}
"""

Batch = tuple[torch.Tensor, torch.Tensor]


class GilFree:
    """Busy-waits of a given length in C, with the GIL released for their whole length.

    ``kind`` says how: ``"spin"`` (a compiled busy-wait on the monotonic clock) or ``"memset"``
    (libc's ``memset`` over a buffer whose length was calibrated to the time asked for).
    """

    def __init__(self, cache: Path | None = None) -> None:
        spin = _compiled_spin(cache or Path(tempfile.gettempdir()))
        self.kind = "spin" if spin is not None else "memset"
        self._spin = spin
        if spin is None:
            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            self._memset = libc.memset
            self._memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            self._buffer = ctypes.create_string_buffer(1 << 22)
            self._bytes_per_us = self._calibrate()

    def call(self, us: float) -> Callable[[], None]:
        """A function of no arguments that busy-waits ``us`` microseconds without the GIL."""
        if self._spin is not None:
            spin, length = self._spin, ctypes.c_double(us)
            return lambda: spin(length)
        memset, buffer = self._memset, self._buffer
        size = max(1, min(len(buffer), int(us * self._bytes_per_us)))
        return lambda: memset(buffer, 0, size)

    def _calibrate(self) -> float:
        size = len(self._buffer)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            self._memset(self._buffer, 0, size)
            times.append(time.perf_counter() - start)
        return size / (min(times) * 1e6)


def _compiled_spin(cache: Path) -> Any:
    """The C busy-wait, compiled into ``cache`` once; None without a C compiler."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    digest = hashlib.sha256(_SPIN_C).hexdigest()[:12]
    library = cache / f"nostall-convoy-{digest}.so"
    if not library.exists():
        if compiler is None:
            return None
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            source, built = Path(tmp) / "spin.c", Path(tmp) / "spin.so"
            source.write_bytes(_SPIN_C)
            made = subprocess.run(
                [compiler, "-O2", "-shared", "-fPIC", "-o", str(built), str(source)],
                capture_output=True,
                check=False,
            )
            if made.returncode != 0:
                return None
            os.replace(built, library)  # atomic: another process may be building it too
    spin = ctypes.CDLL(str(library)).nostall_spin_us  # CDLL: the GIL is released per call
    spin.argtypes, spin.restype = [ctypes.c_double], None
    return spin


@dataclass(frozen=True)
class Case:
    """One setting: the source's and the step's microseconds per batch, in ``k`` calls each."""

    source_us: float
    step_us: float
    k: int

    @property
    def ideal_us(self) -> float:
        """The time per batch with loading and stepping fully overlapped."""
        return max(self.source_us, self.step_us)

    @property
    def label(self) -> str:
        return f"source {self.source_us:g} us, step {self.step_us:g} us, K={self.k}"


#: The settings of the table: even, more calls, loading-bound, step-bound.
CASES = (Case(20, 20, 1), Case(20, 20, 4), Case(20, 20, 8), Case(30, 10, 4), Case(5, 50, 4))


class Source:
    """``n`` batches of two tiny tensors, each made by ``k`` GIL-free calls (an epoch per iter)."""

    def __init__(self, calls: Sequence[Callable[[], None]], n: int) -> None:
        self.calls = tuple(calls)
        self.batches = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        calls = self.calls
        for batch in self.batches:
            for call in calls:
                call()
            yield batch


class Samples(Dataset[Batch]):
    """The same work per item, as a map-style dataset (for ``threads=`` and the DataLoader)."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source.batches)

    def __getitem__(self, i: int) -> Batch:
        for call in self.source.calls:
            call()
        return self.source.batches[i]


class _Epochs:
    """An iterable that calls ``start()`` for each epoch (for the one-shot peers)."""

    def __init__(self, start: Callable[[], Iterable[Batch]]) -> None:
        self._start = start

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._start())


def _seed(source: Iterable[Batch]) -> Iterator[Batch]:
    """The seed documents' design: one thread filling a ``Queue(2)``."""
    items: queue.Queue[Any] = queue.Queue(2)

    def run() -> None:
        for batch in source:
            items.put(batch)
        items.put(items)

    threading.Thread(target=run, name="convoy-seed", daemon=True).start()
    while (batch := items.get()) is not items:
        yield batch


def _prefetch_generator(source: Iterable[Batch]) -> Iterable[Batch]:
    from prefetch_generator import BackgroundGenerator

    return BackgroundGenerator(source, max_prefetch=2)  # type: ignore[no-any-return]


def _torchdata_nodes(source: Iterable[Batch]) -> Iterable[Batch]:
    import torchdata.nodes as tn

    return tn.Loader(tn.Prefetcher(tn.IterableWrapper(source), prefetch_factor=2))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Contender:
    """One way to run the epoch; ``loader``: it reads the map-style dataset through a loader."""

    name: str
    make: Callable[[Source, Samples, int], Iterable[Batch]]
    requires: str | None = None
    loader: bool = False

    def available(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


def _held(source: Source, inline: bool) -> Iterable[Batch]:
    """nostall pulling one way only, never trying the other (``Overlap.fix``)."""
    prefetcher = prefetch(source, "cpu", depth=2)
    prefetcher._lineage.overlap.fix(inline)
    return prefetcher


def _batches_of(samples: Samples) -> DataLoader[Batch]:
    return DataLoader(samples, batch_size=None)


CONTENDERS = (
    Contender("serial loop", lambda s, _, __: s),
    Contender("seed thread+Queue(2)", lambda s, _, __: _Epochs(lambda: _seed(s))),
    Contender(
        "prefetch_generator",
        lambda s, _, __: _Epochs(lambda: _prefetch_generator(s)),
        "prefetch_generator",
    ),
    Contender(
        "torchdata.nodes", lambda s, _, __: _Epochs(lambda: _torchdata_nodes(s)), "torchdata"
    ),
    Contender("nostall", lambda s, _, __: prefetch(s, "cpu", depth=2)),
    # Each of the two ways nostall chooses between, held (to see what the choice chose from).
    Contender("nostall ahead", lambda s, _, __: _held(s, inline=False), "nostall._engine.overlap"),
    Contender("nostall inline", lambda s, _, __: _held(s, inline=True), "nostall._engine.overlap"),
    Contender("serial DataLoader", lambda _, d, __: _batches_of(d), loader=True),
    Contender(
        "nostall threads=N",
        lambda _, d, n: prefetch(_batches_of(d), "cpu", depth=2, threads=n),
        loader=True,
    ),
)


@dataclass
class Result:
    """Microseconds per batch, per case and contender, one value per epoch."""

    spin: str
    threads: int
    realtime: bool
    batches: int
    load_average: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    us: dict[Case, dict[str, list[float]]] = field(default_factory=dict)
    #: Voluntary context switches of the process per batch (a thread blocked: on the GIL, a
    #: lock or a queue), one value per epoch.
    switches: dict[Case, dict[str, list[float]]] = field(default_factory=dict)

    def median(self, case: Case, name: str) -> float:
        return statistics.median(self.us[case][name])


@contextlib.contextmanager
def realtime_priority(wanted: bool) -> Iterator[bool]:
    """Run the block at real-time priority (``SCHED_FIFO`` 10) when ``wanted`` and allowed.

    Threads started in the block inherit it, so the contenders' threads stay on the cores on
    a shared machine. Yields whether it was set.
    """
    if not wanted or not hasattr(os, "sched_setscheduler"):
        yield False
        return
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0)
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (PermissionError, OSError):
        yield False
        return
    try:
        yield True
    finally:
        os.sched_setscheduler(0, before[0], before[1])


def run_convoy(
    cases: Sequence[Case] = CASES,
    *,
    batches: int = 3000,
    epochs: int = 5,
    threads: int = 2,
    names: Sequence[str] = (),
    realtime: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Result:
    """Time every contender on every case, ``epochs`` epochs each, contenders alternating.

    ``names``: only these contenders (all that are installed when empty). ``threads``: the
    loading threads of ``nostall threads=N``. With ``realtime``, the runs are made at
    real-time priority where the process may (see :func:`realtime_priority`).
    """
    gil_free = GilFree()
    chosen = [k for k in CONTENDERS if (not names or k.name in names) and k.available()]
    with realtime_priority(realtime) as applied:
        result = Result(gil_free.kind, threads, applied, batches)
        result.load_average["start"] = os.getloadavg()
        for case in cases:
            source = Source([gil_free.call(case.source_us / case.k)] * case.k, batches)
            step_calls = [gil_free.call(case.step_us / case.k)] * case.k
            samples = Samples(source)
            loops = {k.name: k.make(source, samples, threads) for k in chosen}
            timings: dict[str, list[float]] = {name: [] for name in loops}
            switches: dict[str, list[float]] = {name: [] for name in loops}
            for epoch in range(epochs + 1):  # the first epoch warms up, uncounted
                for name, loop in loops.items():
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                    us = _epoch_us(loop, step_calls, batches)
                    after = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
                    if epoch:
                        timings[name].append(us)
                        switches[name].append((after - before) / batches)
                if progress is not None:
                    progress(f"{case.label}: epoch {epoch}/{epochs}")
            for loop in loops.values():
                if callable(close := getattr(loop, "close", None)):
                    close()
            result.us[case] = timings
            result.switches[case] = switches
        result.load_average["end"] = os.getloadavg()
    return result


def _epoch_us(loop: Iterable[Batch], step_calls: Sequence[Callable[[], None]], n: int) -> float:
    """One epoch of ``loop`` with the step's calls per batch: microseconds per batch."""
    start = time.perf_counter()
    count = 0
    for _ in loop:
        for call in step_calls:
            call()
        count += 1
    elapsed = time.perf_counter() - start
    if count != n:
        raise RuntimeError(f"the convoy epoch delivered {count} batches of {n}")
    return elapsed / n * 1e6


def format_table(result: Result) -> str:
    """The result as a text table: median (min-max) us per batch, per case and contender."""
    from rich.console import Console
    from rich.table import Table

    names = list(next(iter(result.us.values()))) if result.us else []
    table = Table(title="GIL convoy: us per batch, GIL-free calls on both sides")
    for column in ("source us", "step us", "K", "ideal", *names):
        table.add_column(column.replace("threads=N", f"threads={result.threads}"), justify="right")
    for case, timings in result.us.items():
        switches = result.switches.get(case, {})
        cells = [
            f"{statistics.median(t):.1f} ({min(t):.1f}-{max(t):.1f})"
            + (f" {statistics.median(switches[name]):.1f}sw" if switches.get(name) else "")
            for name, t in timings.items()
        ]
        table.add_row(
            f"{case.source_us:g}", f"{case.step_us:g}", str(case.k), f"{case.ideal_us:g}", *cells
        )
    out = Console(width=200, no_color=True, highlight=False, record=True)
    with out.capture() as captured:
        out.print(table)
        start, end = (result.load_average.get(k, (0.0,))[0] for k in ("start", "end"))
        out.print(
            f"median (min-max) us per batch, and the process's voluntary context switches per "
            f"batch (sw); {result.batches} batches an epoch; GIL-free calls: {result.spin}; "
            f"real-time priority: {'yes' if result.realtime else 'no'}; load average "
            f"{start:.2f} at the start, {end:.2f} at the end; torch {torch.__version__}",
            markup=False,
        )
    return captured.get()
