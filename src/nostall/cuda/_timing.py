"""Timing that is right under asynchronous execution.

CUDA calls return before the GPU has done the work: a wall-clock timing around queued kernels
measures how long it took to *queue* them. :class:`Timer` and :func:`timeit` time GPU work with
CUDA events recorded on the current stream, read after the end event completes. On other
accelerators (MPS, XPU, ...) they synchronise the device before and after the timed work and
use the wall clock; on the CPU, the wall clock alone.

:class:`Measured` is what every repeated measurement in nostall is reported as (the median and
the range of its runs): :func:`timeit`'s seconds, ``nostall doctor``'s samples/s, the bench's
figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._device import DeviceLike, resolve_device


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (a no-op on the CPU).

    CUDA through ``torch.cuda``; any other accelerator (MPS, XPU, ...) through
    ``torch.accelerator.synchronize`` where torch has it, else its own module's
    ``synchronize()``, whose ops are just as asynchronous.
    """
    if device.type == "cpu":
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and callable(getattr(accelerator, "synchronize", None)):
        accelerator.synchronize(device)
        return
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if callable(sync):
        sync()


class Timer:
    """A context manager that times the work queued inside it, on the host or on the GPU.

    ``with Timer("cuda") as t: model(x)`` then ``t.seconds`` is the GPU time of the work queued
    in the block (the end event is waited for when ``seconds`` is read). On another accelerator
    the device is synchronised on entry and exit, around a wall-clock timing; on the CPU it is
    the wall clock.
    """

    def __init__(self, device: DeviceLike = None) -> None:
        self.device = resolve_device(device)
        self._start: Any = None
        self._end: Any = None
        self._wall = 0.0

    def __enter__(self) -> Timer:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self._start.record(torch.cuda.current_stream(self.device))
        else:
            synchronize(self.device)  # work queued before the block is not the block's
            self._wall = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            self._end.record(torch.cuda.current_stream(self.device))
        else:
            synchronize(self.device)
            self._wall = time.perf_counter() - self._wall

    @property
    def seconds(self) -> float:
        """The time measured (waits for the GPU when needed)."""
        if self.device.type == "cuda":
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end)) / 1e3
        return self._wall


@dataclass(frozen=True)
class Measured:
    """One figure measured over repeated runs, in any unit: the median and the range.

    The one value type for a measured figure with its spread: :func:`timeit`'s seconds,
    ``nostall doctor``'s samples/s, the bench's speed-ups and microseconds. The unit is the
    caller's; :meth:`describe` names it.

    Invariant: ``runs`` is never empty and holds every run's value in the order they ran, so
    ``low <= median <= high`` and ``n == len(runs)``; a figure that was not measured is None,
    never an empty ``Measured``.
    """

    runs: tuple[float, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.runs, tuple):
            raise TypeError(
                f"Measured(runs=...) takes a tuple of floats (got {type(self.runs).__name__}): "
                f"pass tuple(values)"
            )
        if not self.runs:
            raise ValueError("Measured(runs=...) needs at least one run (got ()): measure first")

    @property
    def median(self) -> float:
        """The median run."""
        return float(statistics.median(self.runs))

    @property
    def low(self) -> float:
        """The least run."""
        return float(min(self.runs))

    @property
    def high(self) -> float:
        """The greatest run."""
        return float(max(self.runs))

    @property
    def n(self) -> int:
        """How many runs."""
        return len(self.runs)

    @property
    def times(self) -> tuple[float, ...]:
        """The runs, under the name ``nostall.cuda.Timing`` gave them (seconds, from timeit)."""
        return self.runs

    @property
    def spread(self) -> float:
        """High minus low, over the median: how noisy the runs were (0 when the median is 0)."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0

    @property
    def exceeds_one(self) -> bool:
        """A ratio measurably above 1: even its least run is (``below_one``: the reverse)."""
        return self.low > 1.0

    @property
    def below_one(self) -> bool:
        """A ratio measurably below 1: even its greatest run is."""
        return self.high < 1.0

    def describe(self, spec: str, unit: str) -> str:
        """``describe(",.0f", "samples/s")``: "1,100 samples/s (1,000-1,200 over 3 runs)".

        One run reads "1,000 samples/s (one run)": a single value has no range to show.
        """
        if self.n == 1:
            return f"{self.median:{spec}} {unit} (one run)"
        low, high = f"{self.low:{spec}}", f"{self.high:{spec}}"
        return f"{self.median:{spec}} {unit} ({low}-{high} over {self.n} runs)"

    def __str__(self) -> str:
        # No unit and no scale known here, so each figure is named: a "1e-06-2e-06" range of
        # seconds would not read as one.
        runs = "1 run" if self.n == 1 else f"{self.n} runs"
        return f"median {self.median:.4g} over {runs} (min {self.low:.4g}, max {self.high:.4g})"

    def __format__(self, spec: str) -> str:
        """``f"{figure:.2f}"`` gives "1.23 (1.20-1.31)": the median, then the range (a cell)."""
        if not spec:
            return str(self)
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"

    def to_dict(self) -> dict[str, Any]:
        """The median, range, count and every run, for JSON."""
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "n": self.n,
            "runs": list(self.runs),
        }


#: ``nostall.cuda.Timing``: another name for :class:`Measured`, public before the figures
#: shared one type; code that names it, or reads ``.times``, keeps working.
Timing = Measured


def timeit(
    fn: Callable[[], Any],
    *,
    repeat: int = 10,
    warmup: int = 2,
    device: DeviceLike = None,
    flush_l2: bool = True,
) -> Measured:
    """Time ``fn()`` ``repeat`` times after ``warmup`` untimed calls; right under asynchrony.

    On CUDA each run is timed with events on the current stream, so queued kernels count in
    full; on another accelerator the device is synchronised around each run; on the CPU, the
    wall clock.

    Args:
        fn: the work to time.
        repeat: timed runs (>= 1).
        warmup: untimed runs first (>= 0).
        device: where ``fn`` runs (default: CUDA if present).
        flush_l2: on CUDA, overwrite a buffer twice the size of the GPU's L2 cache (100 MiB on
            an H100, held until ``timeit`` returns) before each run, outside the timing:
            without it a run finds the inputs the previous one left in L2 and measures a cache
            that training, with its larger working set, never has. Pass False to time the
            warm-cache case (and to allocate nothing).
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0 (got {repeat}, {warmup})")
    dev = resolve_device(device)
    for _ in range(warmup):
        fn()
    flush = _l2_flusher(dev) if flush_l2 else None
    synchronize(dev)
    timers = []
    for _ in range(repeat):
        if flush is not None:
            flush()
        with Timer(dev) as timer:
            fn()
        timers.append(timer)
    return Measured(tuple(t.seconds for t in timers))


def _l2_flusher(device: torch.device) -> Callable[[], Any] | None:
    """A call that evicts the GPU's L2 cache (by writing twice its size), or None off CUDA."""
    if device.type != "cuda":
        return None
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    size = 2 * l2 if l2 else 128 * 2**20  # 128 MiB where the device does not say
    buffer = torch.empty(size // 4, dtype=torch.int32, device=device)
    return buffer.zero_
