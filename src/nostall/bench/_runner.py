"""Running the benchmark: every trial in turn, on the chosen device, into one ``BenchResult``."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from .._device import resolve_device
from .._devices import host_info
from . import _contenders as c
from ._config import BenchConfig
from ._epoch_boundaries import EPOCH_CONTENDERS, run_epochs
from ._gpu_transforms import run_transforms, worker_counts
from ._handoff import run_h2d, run_handoff
from ._progress import Progress
from ._records import BenchResult
from ._sweep import run_ratio
from ._workload import SmallConvNet, calibrate_hash_bytes_per_ms, make_train_step, time_step


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        **host_info(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def chosen_contenders(config: BenchConfig, device: torch.device) -> list[c.Contender]:
    """The contenders that run: those asked for (all by default) that can run here."""
    picked = [k for k in c.ALL if not config.contenders or k.name in config.contenders]
    out: list[c.Contender] = []
    for contender in picked:
        if not contender.available(device):
            continue
        if contender in (c.NOSTALL, c.NOSTALL_WORKERS) and config.depths != (2,):
            out.extend(c.with_depth(contender, d) for d in config.depths)
        else:
            out.append(contender)
    return out


def run_bench(config: BenchConfig) -> BenchResult:
    """Run the whole benchmark; see :class:`BenchConfig` for the knobs."""
    device = resolve_device(config.device)
    cores = os.cpu_count() or 1
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        # Leave cores for loading: the step gets half of them (at least one).
        compute_threads = config.compute_threads or max(1, cores // 2)
        torch.set_num_threads(compute_threads)
        workers = config.workers or max(1, min(8, cores - compute_threads))
    else:
        compute_threads = torch.get_num_threads()
        workers = config.workers or max(1, min(8, cores - 1))
    contenders = chosen_contenders(config, device)
    handoff_contenders = [k for k in contenders if k.prefetcher]
    steps = len(config.ratios) * config.repeats * (len(contenders) + 3) + config.repeats
    steps += len(config.h2d_mb) if device.type == "cuda" else 0
    steps += len(EPOCH_CONTENDERS) if config.epochs else 0
    steps += 2 * len(worker_counts(workers)) if config.gpu_transforms else 0
    progress = Progress(steps, config.progress)
    try:
        model = SmallConvNet(config.width).to(device)
        step = make_train_step(model, device)
        size = config.image_size
        probe = (
            torch.zeros(config.batch_size, 3, size, size, dtype=torch.uint8, device=device),
            torch.zeros(config.batch_size, dtype=torch.int64, device=device),
        )
        compute_s = time_step(step, probe, device, 10)
        machine = machine_info(device)
        machine.update(compute_threads=compute_threads, workers=workers)
        result = BenchResult(config, machine, compute_s * 1e3)
        hash_rate = calibrate_hash_bytes_per_ms()
        for ratio in config.ratios:
            result.ratios.append(
                run_ratio(
                    config, ratio, compute_s, hash_rate, workers, device, contenders, step, progress
                )
            )
        result.handoff_s = run_handoff(config, device, handoff_contenders, progress)
        if config.gpu_transforms:
            result.transforms = run_transforms(config, workers, device, hash_rate, progress)
        if config.epochs:
            result.epoch_intervals = run_epochs(
                config, compute_s, hash_rate, workers, device, step, progress
            )
        if device.type == "cuda":
            result.h2d = [run_h2d(mb, device, progress) for mb in config.h2d_mb]
        return result
    finally:
        torch.set_num_threads(threads_before)
