"""The GPU-regime trial: a step that launches, then waits for the device without the GIL.

On a GPU the training thread holds the GIL only while it launches kernels; every core is free
for loading while the device works. :class:`~._workloads.DeviceStep` models that step on the
CPU, so a machine without a GPU shows what loading threads and processes do there: how close
each contender comes to the device-bound limit (E = epoch time / (batches x device time)), the
share of the epoch waiting, the first batch, the memory loading adds and how much it slows the
launch phase (the GIL shared with loading threads).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from .._engine.profile import profile
from ..cuda._timing import synchronize
from . import _contenders as c
from ._records import BenchResult, Record
from ._workloads import DeviceStep

TRIAL = "gpu regime"
#: Loading capacity over the device's demand when the device time is set from the cores: what
#: the cores can feed with room to spare, so that the best loader can reach the limit.
HEADROOM = 1.25


def device_seconds(dataset: Dataset[Any], batch_size: int, step: DeviceStep) -> float:
    """A device time the cores can feed: ``HEADROOM`` x (loading + launching a batch) / cores.

    Loading is timed serially over three batches (their median), launching alone over ten
    steps; every core can load while the device works, so the cores divide the loading. And
    at least ``HEADROOM`` x the launch: the launch phase is the training thread's alone, no
    core shares it, and a device time under it would make the step launch-bound (seen on an
    H100 with 16 cores: 4.3 ms of device time against 11.9 ms of launches, E 3.5 at best).
    """
    batches, loads = iter(DataLoader(dataset, batch_size)), []
    for _ in range(3):
        start = time.perf_counter()
        batch = next(batches)
        loads.append(time.perf_counter() - start)
    launch = launch_seconds(step, batch)
    fed = HEADROOM * (statistics.median(loads) + launch) / (os.cpu_count() or 1)
    return max(fed, HEADROOM * launch)


def launch_seconds(step: DeviceStep, batch: Any, runs: int = 5) -> float:
    """The launch phase's median seconds alone: whole steps (after one untimed), nothing loading.

    Whole steps, their waits included, as in an epoch: on a busy machine a thread that sleeps
    between launches is scheduled unlike one that launches back to back (measured at load 9:
    17.6 ms back to back against about 3 ms within an epoch), so only the same rhythm compares.
    """
    batch = step.place(batch)
    step(batch)
    return statistics.median(step(batch) for _ in range(runs))


class _Memory:
    """This process's resident memory, and its new child processes' private memory (psutil).

    Threads' batches live in this process; worker processes are children, whose private
    memory (USS) is what they add (what they share with this process after ``fork`` is not).
    Without psutil (the ``bench`` extra) it measures nothing.
    """

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:
            self._process: Any = None
            return
        self._process = psutil.Process()
        # glibc: buffers of 128 KiB and more are mapped alone, so a freed batch leaves RSS
        # (M_MMAP_THRESHOLD, no longer adaptive); elsewhere RSS may keep one: the figure errs low.
        with contextlib.suppress(AttributeError, OSError):
            ctypes.CDLL(None).mallopt(-3, 128 * 1024)

    def children(self) -> set[int]:
        if self._process is None:
            return set()
        return {p.pid for p in self._process.children(recursive=True)}

    def resident(self) -> int:
        return 0 if self._process is None else int(self._process.memory_info().rss)

    def private(self, pids: set[int]) -> int:
        import psutil

        total = 0
        for pid in pids:
            with contextlib.suppress(psutil.Error):  # a worker that ended counts nothing
                total += psutil.Process(pid).memory_full_info().uss
        return total


def device_trial(
    result: BenchResult,
    dataset: Dataset[Any],
    step: DeviceStep,
    contenders: Sequence[c.Contender],
    advance: Callable[[str], None],
) -> None:
    """Every contender loads ``dataset`` for the GPU-regime step, an epoch per repeat.

    Each contender gets its own loaders (the best-practice ``DataLoader`` with a worker per
    core: the step leaves the cores to loading) and a first, untimed epoch that starts its
    workers and gives its first batch (from ``iter()``, a cold start: n=1). Then the contenders
    alternate within each repeat. Records per contender and repeat: ``efficiency`` (E),
    samples/s, ``stall``, ``memory_mib`` (peak resident memory over the epoch less before it,
    plus its workers' private memory) and ``launch_slowdown`` (the epoch's median launch phase
    over the launch phase alone, timed just before the epoch).
    """
    cfg, device = result.config, torch.device(result.machine["device"])
    cores, cuda, memory = os.cpu_count() or 1, device.type == "cuda", _Memory()
    setting = f"{step.device_s * 1e3:.1f} ms"
    probe = next(iter(DataLoader(dataset, cfg.regime_batch_size)))
    result.records.append(Record("step", TRIAL, "device", "ms", step.device_s * 1e3))

    def record(name: str, metric: str, value: float, repeat: int = 0) -> None:
        result.records.append(Record(TRIAL, setting, name, metric, value, repeat))

    loops, workers = {}, {}
    for k in contenders:
        serial = DataLoader(dataset, cfg.regime_batch_size)
        pool = DataLoader(
            dataset, cfg.regime_batch_size, num_workers=cores, pin_memory=cuda,
            persistent_workers=True,
        )  # fmt: skip
        loops[k.name] = k.make(c.Sources(serial, pool), device, cfg.depth)
        before, start = memory.children(), time.perf_counter()
        for i, batch in enumerate(loops[k.name]):
            if not i:
                record(k.name, "first_batch_ms", (time.perf_counter() - start) * 1e3)
            step(batch)
        workers[k.name] = memory.children() - before  # those this contender started
        advance(f"{TRIAL}: {k.name}, first epoch")
    for repeat in range(cfg.repeats):
        for name, loop in loops.items():
            # Alone just before the epoch, nothing loading: the load of the machine then is
            # the epoch's too, so the slowdown is loading's own.
            alone = launch_seconds(step, probe)
            result.records.append(Record("step", TRIAL, "launch alone", "ms", alone * 1e3))
            profiled, launches, samples = profile(loop, device), [], 0
            batch = None  # the last epoch's last batch is not in the base
            base = peak = memory.resident()
            start = time.perf_counter()
            for batch in profiled:
                launches.append(step(batch))
                samples += len(batch[1])
                peak = max(peak, memory.resident())
            synchronize(device)
            epoch_s = time.perf_counter() - start
            added = peak - base + memory.private(workers[name])
            record(name, "efficiency", epoch_s / (len(launches) * step.device_s), repeat)
            record(name, "samples_per_s", samples / epoch_s, repeat)
            record(name, "stall", profiled.report().wait_s / epoch_s, repeat)
            record(name, "memory_mib", added / 2**20, repeat)
            record(name, "launch_slowdown", statistics.median(launches) / alone, repeat)
            advance(f"{TRIAL}: {name}, repeat {repeat + 1}/{cfg.repeats}")
    for loop in loops.values():
        if callable(close := getattr(loop, "close", None)):
            close()
    del loops
    gc.collect()  # the persistent workers stop before the next trial starts its own
