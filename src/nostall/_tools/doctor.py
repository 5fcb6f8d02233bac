"""``nostall doctor``: diagnose a user's own loader, and find a faster way to feed it.

The DS-Analyzer differential method: the loader's rate alone (load only), the step's rate on a
device-resident batch (compute only), and the two together; then a search over loader settings
(:func:`nostall.tune`) with and without ``nostall.prefetch``. This module measures, and writes
the code to change; what the figures mean is :class:`~nostall._tools.diagnosis.Diagnosis`'s to say,
and the report files :mod:`nostall._tools.doctor_report`'s to write.

On a shared machine one run of anything moves by several times with the load, so what is
compared is measured in turns, with repeats: loading alone and the step alone alternate; the
loop as built and the leading settings alternate (in :func:`nostall.tune`). The load average
is recorded for the verdict to weigh.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import _arguments
from .._device import DeviceLike, resolve_data_device
from .._exceptions import ConfigurationError
from ..cuda._timing import Measured, synchronize
from ..cuda._transfer import to_device
from ..cuda._tree import batch_size_of
from .diagnosis import Diagnosis, draws_line, per_s, too_busy
from .specs import checked_factory
from .tune import (
    YOURS,
    Factory,
    Setting,
    Step,
    Transform,
    TuneResult,
    loader_kwargs,
    measure,
    tune,
)

DEFAULT = YOURS

#: Batches each timed run pulls: two start-up batches, then the timed ones.
RUN_BATCHES = 12
#: Steps each run of the step alone times (after one warm-up step before the first run).
STEP_RUN = 5


def diagnose(
    factory: Factory,
    *,
    step: Step | None = None,
    device: DeviceLike = None,
    max_batches: int = 300,
    repeats: int = 3,
    transform: Transform | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> Diagnosis:
    """Measure the user's loader (and step), search for a faster setting, and say what to do.

    Args:
        factory: builds the loader (see :mod:`nostall._tools.tune`).
        step: the training step, called with a batch on the device.
        device: where batches go (default: CUDA when available).
        max_batches: the most batches the settings search (:func:`nostall.tune`) may pull, its
            runs of the loop as built and of the leading settings measured again included;
            the runs around it pull ``2 * repeats * 14`` more (loading alone, the best found
            without ``nostall.prefetch``), and the step alone one. Where the search had no
            room to measure again, the doctor measures the loop as built and the best found
            itself (``2 * repeats * 14`` more).
        repeats: runs of each compared figure (the loader alone and the step alone, in turns;
            the loop as built, the best found with and without ``nostall.prefetch``); a
            speed-up is claimed only when every run of the best beat every run of the loop as
            built, and never from one run. The step runs with the intra-op threads
            (``torch.get_num_threads()``) that the caller's thread has, as in the user's loop.
        transform: what the pipeline applies to each batch on the device, as
            ``nostall.prefetch(loader, transform=...)`` does: measured with it.
        progress: called with each phase's description and the share of the work done (0-1).

    Exceptions raised by ``factory``, by the loaders it builds, by ``step`` or ``transform``
    propagate unchanged, with their tracebacks: they are the user's code failing.

    Raises:
        ConfigurationError: (a ``ValueError``) the factory does not return an iterable, its
            loader yields fewer than 3 batches (nothing to time), or it loads only in the
            thread that built it, so that nostall's background thread cannot load it (see
            :func:`nostall.tune`).
        TypeError: ``factory``, ``step``, ``transform`` or ``progress`` is not callable, a
            count not an int; ``device`` of a type that names no device.
        ValueError: ``max_batches`` or ``repeats`` < 1; ``device`` names no device, or the meta
            device (no data to measure).
        DeviceUnavailableError: ``device`` is not on this machine.
    """
    hint = "pass the function that builds your loader (make_loader, not make_loader())"
    _arguments.function("diagnose", "factory", factory, hint=hint)
    _arguments.function("diagnose", "step", step, optional=True, hint="pass step(batch)")
    _arguments.integer("diagnose", "max_batches", max_batches, low=1, example=300)
    _arguments.integer("diagnose", "repeats", repeats, low=1, example=3)
    _arguments.function("diagnose", "transform", transform, optional=True, hint="e.g. a Normalize")
    _arguments.function("diagnose", "progress", progress, optional=True, hint="e.g. print")
    dev = resolve_data_device(device)
    build = checked_factory(factory)
    threads = torch.get_num_threads()  # the user's loop runs the step with these
    run_cost = RUN_BATCHES + 2
    total = 4 * repeats * run_cost + max_batches
    done = 0
    load_averages = [load_average()]

    def say(phase: str) -> None:
        if progress is not None:
            progress(phase, min(done / total, 1.0))

    def run(setting: Setting, phase: str, with_step: bool = True) -> float:
        nonlocal done
        say(phase)
        rate, used = measure(
            build,
            setting,
            dev,
            batches=RUN_BATCHES,
            step=step if with_step else None,
            transform=transform,
        )
        done += run_cost
        if used < 3:
            raise ConfigurationError(_too_few(factory, used))
        return rate

    # Loading alone and the step alone, in turns: a change in the machine's load falls on both.
    loads: list[float] = []
    steps: list[float] = []
    batch = None
    for i in range(repeats):
        of = f"(run {i + 1} of {repeats})"
        loads.append(run(DEFAULT, f"load only: the loader as the factory builds it {of}", False))
        if step is not None:
            say(f"step only: your step on one device-resident batch {of}")
            if batch is None:
                batch = _device_batch(build, step, dev, transform, threads)
            steps.append(_step_rate(batch, step, dev, threads))
    load = Measured(tuple(loads))
    step_rate = Measured(tuple(steps)) if steps else None
    load_averages.append(load_average())

    def trial(setting: Setting, rate: float, spent: int) -> None:
        nonlocal done
        done = repeats * run_cost + spent
        say(f"searching settings: {setting.describe()}: {rate:,.0f} samples/s")

    say(f"searching loader settings with nostall.prefetch (at most {max_batches} batches)")
    search = tune(
        build,
        max_batches=max_batches,
        device=dev,
        step=step,
        transform=transform,
        on_trial=trial,
        repeats=repeats,
    )
    done = repeats * run_cost + max_batches
    load_averages.append(load_average())
    plain = Setting(search.best.num_workers, None)
    # What the search did not measure again, in turns, and the best without nostall.
    wanted = [s for s in (DEFAULT, search.best) if not _has_runs(search.measured(s), repeats)]
    runs: dict[Setting, list[float]] = {s: [] for s in (*wanted, plain)}  # each setting once
    for i in range(repeats):
        for setting in runs:
            runs[setting].append(
                run(setting, f"again: {setting.describe()} (run {i + 1} of {repeats})")
            )
    load_averages.append(load_average())

    def measured(setting: Setting) -> Measured:
        if setting in runs:
            return Measured(tuple(runs[setting]))
        again = search.measured(setting)
        assert again is not None  # what the search did not measure again is in runs
        return again

    diagnosis = Diagnosis(
        load,
        step_rate,
        measured(DEFAULT),
        search,
        (search.best, measured(search.best)),
        (plain, Measured(tuple(runs[plain]))),
        str(dev),
    )
    diagnosis.factory_workers = _default_workers(factory)
    known = [a for a in load_averages if a is not None]
    diagnosis.load_average = max(known) if known else None
    diagnosis.cores = os.cpu_count()
    diagnosis.threads = threads
    if diagnosis.speedup is not None:  # only a change measurably faster is one to make
        diagnosis.code = recommend(
            factory, diagnosis.best[0], dev, transform, search.drew, diagnosis.factory_workers
        )
    done = total
    say("done")
    return diagnosis


def _has_runs(rate: Measured | None, repeats: int) -> bool:
    return rate is not None and rate.n >= repeats


def load_average() -> float | None:
    """The one-minute load average (None where the system keeps none: Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def recommend(
    factory: Factory,
    setting: Setting,
    device: Any,
    transform: Any,
    drew: tuple[str, ...] = (),
    factory_workers: int | None = None,
) -> str:
    """The code that builds and feeds the loader with ``setting``, as the user would write it.

    A setting that changes the random draws the model sees (another ``num_workers``, or
    ``threads=``, for a loader whose dataset or collate_fn draws from a global generator:
    ``drew``) says so in the code itself, in a comment above it.
    """
    name = getattr(factory, "__name__", "make_loader")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in loader_kwargs(factory, setting, device).items())
    lines = []
    workers = setting.num_workers
    if drew and setting.threads is not None:
        lines.append(
            f"    # NOTE: this changes the random draws your model sees: your dataset or "
            f"collate_fn draws from {' and '.join(drew)}, which under threads= each sample "
            f"draws from a generator of its own (reproducible, but not the values "
            f"num_workers={factory_workers or 0} draws). Keep them: give the draws a seeded "
            f"generator of their own."
        )
    elif drew and workers is not None and workers != (factory_workers or 0):
        lines.append(
            f"    # NOTE: this changes the random draws your model sees: your dataset or "
            f"collate_fn draws from {' and '.join(drew)}, which with num_workers={workers} "
            f"each worker seeds itself (reproducible, but not the values "
            f"num_workers={factory_workers or 0} draws). Keep them: give the draws a seeded "
            f"generator of their own."
        )
    lines.append(f"    loader = {name}({kwargs})")
    if setting.depth is None:
        lines.append("    for batch in loader:  # move each batch to the device in the loop")
    else:
        extra = (
            ""
            if transform is None
            else f", transform={getattr(transform, '__name__', 'transform')}"
        )
        threads = "" if setting.threads is None else f", threads={setting.threads}"
        lines.append(
            f"    for batch in nostall.prefetch(loader, {str(device)!r}, depth={setting.depth}"
            f"{threads}{extra}):"
        )
    return "\n".join(lines)


def tune_summary(
    result: TuneResult,
    factory: Factory,
    device: Any,
    transform: Transform | None = None,
    load: tuple[float | None, float | None] = (None, None),
) -> str:
    """What ``nostall tune`` prints: the best found beside the loop as built, and the code.

    The same rule as the doctor's: the code to paste only where the best is measurably faster
    than the loop as built (:attr:`TuneResult.speedup`); otherwise what the figures allow.
    ``load``: the one-minute load average when the search began and when it ended, said
    last, as the doctor says it (None where the system keeps none).
    """
    rate = result.rate
    lines = [f"best found: {result.best.describe()}, {per_s(rate)}."]
    yours = result.yours
    if yours is None:
        lines.append(
            "your loop as built was not measured beside it (--repeats 1, or a --max-batches "
            "too small to measure again): cannot tell whether the best found is faster."
        )
    else:
        lines.append(f"yours, as built ({YOURS.describe()}): {per_s(yours)}.")
        speedup = result.speedup
        if speedup is not None:
            code = recommend(factory, result.best, device, transform, result.drew)
            lines.append(f"measurably faster: {speedup:.2f}x yours. change your code to:\n{code}")
        elif rate.high < yours.low:
            lines.append("your loop as built ran faster than every setting tried: keep it.")
        else:
            lines.append(
                "no setting is measurably faster: the best found ran within the spread of "
                "yours; keep yours."
            )
    if result.drew:
        lines.append(draws_line(result.drew))
    if result.thread_safety is not None:
        lines.append(result.thread_safety.describe())
    machine = tune_machine_line(*load)
    if machine is not None:
        lines.append(machine)
    return "\n".join(lines)


def tune_machine_line(start: float | None, end: float | None) -> str | None:
    """The load ``nostall tune`` measured under, and what a busy machine means for its claims."""
    known = [a for a in (start, end) if a is not None]
    if not known:
        return None
    cores = os.cpu_count()
    at = ", ".join(
        f"{a:.1f} at the {when}" for a, when in ((start, "start"), (end, "end")) if a is not None
    )
    line = f"machine: load average {at}" + (f" on {cores} cores." if cores else ".")
    if too_busy(max(known), cores):
        line += (
            " More processes wanted the cores than there are, so every figure moves with them: "
            "a setting is called faster only where every run of it beat every run of yours; "
            "run again when the machine is quieter to compare settings closer than that."
        )
    return line


def _too_few(factory: Factory, used: int) -> str:
    name = getattr(factory, "__name__", "the factory")
    if used == 0:
        return (
            f"the loader that {name}() builds yields no batches (an empty dataset, or "
            f"drop_last=True with fewer samples than batch_size?): there is nothing to measure"
        )
    return (
        f"the loader that {name}() builds yields only {used} batch{'es' if used > 1 else ''}: "
        f"the doctor needs at least 3 to time it; give it a larger dataset"
    )


def _device_batch(
    build: Factory, step: Step, device: Any, transform: Transform | None, threads: int
) -> Any:
    """One batch on the device, transformed, after one warm-up step on it."""
    batch = to_device(next(iter(build())), device)
    if transform is not None:
        batch = transform(batch)
    with _intra_op_threads(threads):
        step(batch)
        synchronize(device)
    return batch


def _step_rate(batch: Any, step: Step, device: Any, threads: int) -> float:
    """Samples/s of ``step`` alone on ``batch``, over :data:`STEP_RUN` steps, at ``threads``."""
    with _intra_op_threads(threads):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(STEP_RUN):
            step(batch)
        synchronize(device)
        elapsed = time.perf_counter() - start
    return STEP_RUN * (batch_size_of(batch) or 1) / elapsed if elapsed > 0 else 0.0


@contextlib.contextmanager
def _intra_op_threads(threads: int) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads, as the user's loop has them.

    The count is per thread, and the measuring around the step (a prefetcher's hand-over)
    may have left this thread's at another: the step alone must run as it runs in the loop.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _default_workers(factory: Callable[..., Any]) -> int | None:
    """The ``num_workers`` the factory uses when not given one (None: not an int default)."""
    try:
        default = inspect.signature(factory).parameters["num_workers"].default
    except (KeyError, TypeError, ValueError):
        return None
    return default if isinstance(default, int) and not isinstance(default, bool) else None
