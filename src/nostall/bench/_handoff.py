"""What crossing to the loop costs: hand-off overhead per batch, host-to-device copy rates."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .._prefetcher import prefetch
from .._timing import synchronize
from . import _contenders as c
from ._config import BenchConfig
from ._metrics import gb_per_s
from ._progress import Progress


def run_handoff(
    config: BenchConfig, device: torch.device, contenders: Sequence[c.Contender], progress: Progress
) -> dict[str, list[float]]:
    """Loop seconds over an instant in-memory source, per contender, plus the serial baseline."""
    items = [
        (torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(config.handoff_batches)
    ]
    sources = c.Sources(serial=items, workers=items)
    loops = {k.name: k.make(sources, device, 2) for k in contenders}
    loops[c.SERIAL.name] = c.SERIAL.make(sources, device, 2)
    times: dict[str, list[float]] = {name: [] for name in loops}
    for repeat in range(config.repeats):
        for name, loop in loops.items():
            start = time.perf_counter()
            for _ in loop:
                pass
            synchronize(device)
            times[name].append(time.perf_counter() - start)
        progress.step(f"hand-off repeat {repeat + 1}/{config.repeats}")
    return times


def run_h2d(megabytes: float, device: torch.device, progress: Progress) -> dict[str, float]:
    """Host-to-device GB/s: raw pinned and pageable copies, and nostall moving such batches."""
    numel = int(megabytes * 1e6) // 4
    nbytes = numel * 4
    copies = max(8, min(64, int(2e9 // nbytes)))
    pinned = torch.ones(numel).pin_memory()
    pageable = torch.ones(numel)
    target = torch.empty(numel, device=device)

    def raw(src: torch.Tensor) -> float:
        target.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(copies):
            target.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return gb_per_s(copies * nbytes, start.elapsed_time(end) / 1e3)

    def through_nostall(batches: list[torch.Tensor]) -> float:
        p = prefetch(batches, device)
        for _ in p:  # warm-up epoch: the copy stream and pinned-memory caches fill
            pass
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in p:
            pass
        torch.cuda.synchronize(device)
        return gb_per_s(len(batches) * nbytes, time.perf_counter() - start)

    out = {
        "megabytes": nbytes / 1e6,
        "raw_pinned_gb_s": raw(pinned),
        "raw_pageable_gb_s": raw(pageable),
        "nostall_pinned_source_gb_s": through_nostall([pinned] * copies),
        "nostall_pageable_source_gb_s": through_nostall([pageable] * copies),
    }
    progress.step(f"host-to-device {megabytes:g} MB")
    return out
