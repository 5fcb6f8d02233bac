"""The ratio sweep: every contender through the same workload, alternating, repeated.

Also the timed loops the other trials reuse: one epoch of a training loop, a drain with no
consumer, and the workload's dataset at a load/compute ratio.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._timing import synchronize
from .._transfer import to_device
from . import _contenders as c
from ._config import BenchConfig
from ._progress import Progress
from ._records import RatioResult, Run
from ._workload import SyntheticImages, time_step


def time_epoch(
    batches: Iterable[Any], step: Callable[[Any], float], device: torch.device
) -> tuple[float, float]:
    """Run one epoch; return (loop seconds, seconds blocked waiting for the next batch).

    Creating the iterator is inside the loop time (worker start-up belongs to the epoch).
    """
    waited = 0.0
    start = time.perf_counter()
    it = iter(batches)
    while True:
        before = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - before
        step(batch)
    synchronize(device)
    return time.perf_counter() - start, waited


def time_drain(source: Iterable[Any]) -> float:
    """Load-only: drain ``source`` with a consumer that does nothing."""
    start = time.perf_counter()
    for _ in source:
        pass
    return time.perf_counter() - start


def dataset_at(
    config: BenchConfig, ratio: float, compute_s: float, hash_rate: float
) -> SyntheticImages:
    """The workload's dataset, its samples costing ``ratio`` times the step, per batch."""
    load_ms = ratio * compute_s * 1e3 / config.batch_size
    return SyntheticImages(
        config.batches * config.batch_size,
        image_size=config.image_size,
        decode_ms=load_ms * (1 - config.io_share),
        io_ms=load_ms * config.io_share,
        hash_bytes_per_ms=hash_rate,
    )


def run_ratio(
    config: BenchConfig,
    ratio: float,
    compute_s: float,
    hash_rate: float,
    workers: int,
    device: torch.device,
    contenders: Sequence[c.Contender],
    step: Callable[[Any], float],
    progress: Progress,
) -> RatioResult:
    """Every contender at one ratio, alternating within each repeat, with load and compute alone.

    The persistent workers start before the first repeat and are shut down before returning,
    so that no ratio's workers compete with the next ratio's.
    """
    dataset = dataset_at(config, ratio, compute_s, hash_rate)
    load_ms = dataset.decode_ms + dataset.io_ms
    cuda = device.type == "cuda"
    sources = c.Sources(
        serial=DataLoader(dataset, batch_size=config.batch_size),
        workers=DataLoader(
            dataset,
            batch_size=config.batch_size,
            num_workers=workers,
            pin_memory=cuda,
            persistent_workers=True,
        ),
    )
    out = RatioResult(ratio, load_ms)
    loops = {k.name: (k, k.make(sources, device, config.depths[0])) for k in contenders}
    time_drain(sources.workers)  # starts the persistent workers: not part of any epoch
    first = next(iter(sources.serial))
    device_batch = to_device(first, device)
    for repeat in range(config.repeats):
        label = f"ratio {ratio:g} repeat {repeat + 1}/{config.repeats}"
        for name in ("serial", "workers"):
            out.load_only_s.setdefault(name, []).append(time_drain(getattr(sources, name)))
            progress.step(f"{label}: load only ({name})")
        out.compute_only_s.append(
            time_step(step, device_batch, device, config.batches) * config.batches
        )
        progress.step(f"{label}: compute only")
        for name, (contender, loop) in loops.items():
            epoch, waited = time_epoch(loop, step, device)
            run = out.runs.setdefault(name, Run(name, contender.source, contender.unsafe))
            run.epoch_s.append(epoch)
            run.wait_s.append(waited)
            progress.step(f"{label}: {name}")
    for _, loop in loops.values():
        close = getattr(loop, "close", None)
        if callable(close):
            close()
    del loops, sources
    gc.collect()  # shuts the persistent workers down before the next ratio starts its own
    return out
