"""The bench's trials, each adding its :class:`Record` rows, and ``run_bench`` running them.

Epoch trials time whole training epochs, the contenders alternating within each repeat, the
waits taken from :func:`nostall.profile`; micro-benchmarks run on ``torch.utils.benchmark``.
"""

from __future__ import annotations

import gc
import itertools
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import benchmark
from torch.utils.data import DataLoader, Dataset

from .._device import resolve_device
from .._engine.profile import profile
from .._sources.global_draws import GlobalDrawsWarning
from ..cuda._devices import host_info
from ..cuda._timing import synchronize
from . import _contenders as c
from ._config import BenchConfig
from ._convoy import CASES, run_convoy
from ._records import BenchResult, Record
from ._regime import device_seconds, device_trial
from ._workloads import (
    AugmentedJpegImages,
    DeviceStep,
    JpegImages,
    SyntheticImages,
    jpeg_files,
    train_step,
)

#: The augmented JPEG setting's name after its size: random resized crops and flips.
AUGMENTED = "crop+flip"

Step = Callable[[Any], float]


def _micro(result: BenchResult, key: tuple[str, str, str], stmt: str, **scope: Any) -> list[float]:
    """Seconds per run of ``stmt`` for each block ``blocked_autorange`` timed (kept for Compare)."""
    label, setting, who = key
    threads = torch.get_num_threads()
    names: dict[str, Any] = {"label": label, "sub_label": who, "description": setting}
    timer = benchmark.Timer(stmt, globals=scope, num_threads=threads, **names)
    measured = timer.blocked_autorange(min_run_time=result.config.min_run_time)
    result.measurements.append(measured)
    return list(measured.times)


def _add(result: BenchResult, trial: str, key: tuple[str, str, str], values: Any) -> None:
    """One record per value, numbered: (trial, setting, contender, metric) = key."""
    result.records.extend(Record(trial, *key, v, i) for i, v in enumerate(values))


def step_seconds(result: BenchResult, workload: str, step: Step, batch: Any) -> float:
    """The training step's median seconds on one device-resident batch."""
    times = _micro(result, ("step alone", workload, "step"), "step(b)", step=step, b=batch)
    _add(result, "step", (workload, "step", "ms"), (t * 1e3 for t in times))
    return statistics.median(times)


def epoch_trial(
    result: BenchResult,
    trial: str,
    setting: str,
    dataset: Dataset[Any],
    step: Step,
    contenders: Sequence[c.Contender],
    advance: Callable[[str], None],
    batch_size: int | None = None,
) -> None:
    """Every contender trains one epoch of ``dataset`` per repeat, alternating.

    In batches of ``batch_size`` (default: the config's).

    Records per contender and repeat: samples/s; the stall (share of the epoch waiting for the
    next batch); against the serial loader of the same repeat, the speed-up and the share of
    its waiting removed. The persistent workers start before the first repeat and stop before
    returning, so that no trial's workers compete with the next one's.
    """
    cfg, device, count = (
        result.config,
        torch.device(result.machine["device"]),
        result.machine["workers"],
    )
    cuda, size = device.type == "cuda", batch_size or cfg.batch_size
    workers = DataLoader(dataset, size, num_workers=count, pin_memory=cuda, persistent_workers=True)
    sources = c.Sources(DataLoader(dataset, batch_size=size), workers)
    loops = {k.name: k.make(sources, device, cfg.depth) for k in contenders}
    for _ in workers:  # starts the persistent workers, outside every timed epoch
        pass

    def record(name: str, metric: str, value: float, repeat: int) -> None:
        result.records.append(Record(trial, setting, name, metric, value, repeat))

    for repeat in range(cfg.repeats):
        epoch_s, wait_s = {}, {}
        for name, loop in loops.items():
            profiled, samples = profile(loop, device), 0
            start = time.perf_counter()
            for batch in profiled:
                step(batch)
                samples += len(batch[1])
            synchronize(device)
            epoch_s[name] = time.perf_counter() - start
            wait_s[name] = profiled.report().wait_s
            record(name, "samples_per_s", samples / epoch_s[name], repeat)
            record(name, "stall", wait_s[name] / epoch_s[name], repeat)
            advance(f"{trial} {setting}: {name}, repeat {repeat + 1}/{cfg.repeats}")
        serial = c.SERIAL.name
        for name in epoch_s if serial in epoch_s else ():
            removed = 1 - wait_s[name] / wait_s[serial] if wait_s[serial] > 0 else 0.0
            record(name, "speedup", epoch_s[serial] / epoch_s[name], repeat)
            record(name, "wait_removed", removed, repeat)
    for loop in loops.values():
        if callable(close := getattr(loop, "close", None)):
            close()
    del loops, sources, workers
    gc.collect()  # the persistent workers stop before the next trial starts its own


def handoff_trial(result: BenchResult, contenders: Sequence[c.Contender]) -> None:
    """Each prefetcher's cost per batch over a plain loop, on an instant in-memory source.

    A timed block's figure is its loop time less the plain loop's median, per batch.
    """
    n, device = result.config.handoff_batches, torch.device(result.machine["device"])
    items = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
    base = None
    for k in [c.SERIAL, *(k for k in contenders if k.prefetcher)]:
        loop = k.make(c.Sources(items, items), device, 2)
        times = _micro(result, (f"hand-off, {n} batches", "", k.name), "for _ in x: pass", x=loop)
        base = statistics.median(times) if base is None else base  # the serial loop's
        _add(result, "handoff", ("", k.name, "us_per_batch"), ((t - base) / n * 1e6 for t in times))


#: The GIL convoy's contenders in the bench: the loop without nostall, the seed, nostall.
CONVOY = ("serial loop", "seed thread+Queue(2)", "nostall")


def convoy_trial(result: BenchResult) -> None:
    """The hand-off when both threads make GIL-free calls (see :mod:`nostall.bench._convoy`).

    Records per case (source us, step us, K) and contender: us per batch, one per epoch.
    """
    found = run_convoy(CASES, batches=result.config.convoy_batches, epochs=3, names=CONVOY)
    result.machine["convoy_calls"] = found.spin
    for case, timings in found.us.items():
        setting = f"{case.source_us:g},{case.step_us:g},{case.k}"
        for name, values in timings.items():
            _add(result, "convoy", (setting, name, "us_per_batch"), values)


def run_bench(
    config: BenchConfig, progress: Callable[[str, float], None] | None = None
) -> BenchResult:
    """Run every trial the config asks for; ``progress(what, fraction_done)`` follows along.

    On the CPU the step gets half the cores (``compute_threads``) and the loader workers the
    rest, so that loading and computing do not fight over one core; the setting is restored.
    """
    device = resolve_device(config.device)
    cores, threads_before = c.usable_cores(), torch.get_num_threads()
    cpu = device.type == "cpu"
    # On a GPU the step's own CPU work is launching kernels: a quarter of the cores leave the
    # rest to loading (torch's default, every core, oversubscribed them beside threads=).
    threads = config.compute_threads or max(1, cores // 2 if cpu else cores // 4)
    workers = config.workers or max(1, min(8, cores - (threads if cpu else 1)))
    machine = {**host_info(), "device": str(device), "compute_threads": threads, "workers": workers}
    machine.update(usable_cores=cores, loading_threads=c.THREADS)
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
    result = BenchResult(config, machine, {"start": list(os.getloadavg())})
    contenders = c.chosen(config.contenders, device)
    regime = c.chosen(config.contenders, device, c.GPU_REGIME) if config.regime_batches else []
    # The augmented JPEG trial adds the decode on the device to the contenders.
    decode = c.chosen(config.contenders, device, (c.DECODE,)) if config.jpeg_images else []
    trials = len(config.ratios) + 2 * bool(config.jpeg_images)
    total = (trials * len(contenders) + len(decode)) * config.repeats
    total += (1 + config.repeats) * len(regime)
    done = itertools.count(1)

    def advance(what: str) -> None:
        if progress is not None:
            progress(what, min(1.0, next(done) / total))

    started = time.perf_counter()
    torch.set_num_threads(threads)
    try:
        if regime:  # the headline: the regime users train in, measured first
            paths = jpeg_files(config.jpeg_cache, config.jpeg_images or 64)
            length = config.regime_batches * config.regime_batch_size
            loading = JpegImages(paths, config.jpeg_size, length)
            gpu_step = DeviceStep(config.launch_ops, config.device_ms / 1e3, device)
            if not gpu_step.device_s:
                gpu_step.device_s = device_seconds(loading, config.regime_batch_size, gpu_step)
            device_trial(result, loading, gpu_step, regime, advance)
        step = train_step(config.width, device)
        n, size = config.batch_size, config.image_size
        labels = torch.zeros(n, dtype=torch.int64, device=device)
        probe = torch.zeros(n, 3, size, size, dtype=torch.uint8, device=device)
        step_s = step_seconds(result, "synthetic", step, (probe, labels))
        for ratio in config.ratios:
            load_ms = ratio * step_s * 1e3 / n  # per sample
            cpu_ms, io_ms = load_ms * (1 - config.io_share), load_ms * config.io_share
            dataset = SyntheticImages(config.batches * n, size=size, decode_ms=cpu_ms, io_ms=io_ms)
            epoch_trial(result, "synthetic", f"{ratio:g}", dataset, step, contenders, advance)
        if config.jpeg_images:
            paths = jpeg_files(config.jpeg_cache, config.jpeg_images)
            step = train_step(config.jpeg_width, device)
            s, n = config.jpeg_size, config.jpeg_batch_size
            probe = torch.zeros(n, 3, s, s, dtype=torch.uint8, device=device)
            labels = torch.zeros(n, dtype=torch.int64, device=device)
            step_seconds(result, "jpeg", step, (probe, labels))
            images = JpegImages(paths, s)
            epoch_trial(result, "jpeg", f"{s}px", images, step, contenders, advance, n)
            # What users run: torchvision-style crops and flips from torch's global generator.
            augmented = AugmentedJpegImages(paths, s)
            with warnings.catch_warnings():  # nostall's warning of draws, said in the report
                warnings.simplefilter("ignore", GlobalDrawsWarning)
                setting = f"{s}px {AUGMENTED}"
                everyone = [*contenders, *decode]
                epoch_trial(result, "jpeg", setting, augmented, step, everyone, advance, n)
        handoff_trial(result, contenders)
        if config.convoy_batches:
            convoy_trial(result)
        result.seconds = time.perf_counter() - started
        result.load_average["end"] = list(os.getloadavg())
        return result
    finally:
        torch.set_num_threads(threads_before)
