"""Timing that is right under asynchronous execution.

CUDA calls return before the GPU has done the work: a wall-clock timing around queued kernels
measures how long it took to *queue* them. :class:`Timer` and :func:`timeit` time GPU work with
CUDA events recorded on the current stream, read after the end event completes. On other
accelerators (MPS, XPU, ...) they synchronise the device before and after the timed work and
use the wall clock; on the CPU, the wall clock alone.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._device import DeviceLike, resolve_device


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
class Timing:
    """Repeated timings of one callable, in seconds."""

    times: tuple[float, ...]

    @property
    def median(self) -> float:
        """The median run."""
        return float(statistics.median(self.times))

    @property
    def spread(self) -> float:
        """Max minus min, over the median: how noisy the runs were."""
        return (max(self.times) - min(self.times)) / self.median if self.median > 0 else 0.0

    def __str__(self) -> str:
        return (
            f"median {self.median * 1e3:.3f} ms over {len(self.times)} runs "
            f"(min {min(self.times) * 1e3:.3f}, max {max(self.times) * 1e3:.3f})"
        )


def timeit(
    fn: Callable[[], Any],
    *,
    repeat: int = 10,
    warmup: int = 2,
    device: DeviceLike = None,
    flush_l2: bool = True,
) -> Timing:
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
    return Timing(tuple(t.seconds for t in timers))


def _l2_flusher(device: torch.device) -> Callable[[], Any] | None:
    """A call that evicts the GPU's L2 cache (by writing twice its size), or None off CUDA."""
    if device.type != "cuda":
        return None
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
    size = 2 * l2 if l2 else 128 * 2**20  # 128 MiB where the device does not say
    buffer = torch.empty(size // 4, dtype=torch.int32, device=device)
    return buffer.zero_
