"""``nostall doctor``: diagnose a user's own loader, and find a faster way to feed it.

The DS-Analyzer differential method: the loader's rate alone (load only), the step's rate on a
device-resident batch (compute only), and the two together; then a search over loader settings
(:func:`nostall.tune`) with and without ``nostall.prefetch``.
"""

from __future__ import annotations

import html
import inspect
import json
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _arguments
from ._device import DeviceLike, resolve_data_device
from ._exceptions import ConfigurationError
from ._specs import checked_factory
from ._timing import Measured, synchronize
from ._transfer import to_device
from ._tree import batch_size_of
from ._tune import Factory, Setting, Step, Transform, TuneResult, loader_kwargs, measure, tune

DEFAULT = Setting(None, None)

#: Threads against worker processes, one run each: the ratio that names one the faster.
CLEAR_RATIO = 1.25


def _per_s(rate: Measured) -> str:
    """A rate as the doctor writes it: "1,100 samples/s (1,000-1,200 over 3 runs)"."""
    return rate.describe(",.0f", "samples/s")


@dataclass
class Diagnosis:
    """What the doctor measured and concluded (samples/s throughout).

    Invariant: ``speedup`` is None unless the best setting's slowest run beat the fastest run
    of the loop as built (the spreads do not overlap); then it is the ratio of the medians, > 1.
    """

    load: Measured
    step_rate: float | None
    as_built: Measured
    search: TuneResult
    with_nostall: tuple[Setting, Measured]
    without_nostall: tuple[Setting, Measured]
    device: str
    code: str = ""  # the change to make, as code (empty when nothing is measurably faster)
    #: The factory's own num_workers (its default), when it has one: the loop as built uses it.
    factory_workers: int | None = None

    @property
    def bound(self) -> str:
        """input-bound, compute-bound or balanced; unknown without a step."""
        if self.step_rate is None:
            return "unknown (no --step given)"
        if self.load.median < 0.9 * self.step_rate:
            return "input-bound"
        if self.load.median > 1.1 * self.step_rate:
            return "compute-bound"
        return "balanced"

    @property
    def best(self) -> tuple[Setting, Measured]:
        """The fastest setting found (by median), with or without nostall."""
        return max(self.with_nostall, self.without_nostall, key=lambda pair: pair[1].median)

    @property
    def speedup(self) -> float | None:
        """The best setting's median over the loop as built, when measurably faster, else None."""
        rate = self.best[1]
        if rate.low <= self.as_built.high:
            return None
        return rate.median / self.as_built.median

    def summary(self) -> str:
        """The diagnosis in plain words, ending with the code change when there is one."""
        setting, best = self.best
        rate = _per_s(best)
        step = (
            f", step {self.step_rate:,.0f} samples/s"
            if self.step_rate is not None
            else " (pass --step to compare with your training step)"
        )
        lines = [
            f"{self.bound}: loading {_per_s(self.load)}{step}.",
            f"as built, the loop runs at {_per_s(self.as_built)}.",
        ]
        speedup = self.speedup
        if speedup is None:
            yours = setting.depth is None and setting.num_workers in (None, self.factory_workers)
            found = (
                f"the best found is your loop as built ({setting.describe()}), at {rate}"
                if yours
                else f"the best found, {setting.describe()}, ran at {rate}, within the spread of "
                f"yours"
            )
            lines.append(f"no setting is measurably faster: {found}.")
        else:
            lines.append(f"measurably faster: {setting.describe()}, {rate}: {speedup:.2f}x yours.")
            lines.append(f"change your code to:\n{self.code}")
        if self.search.drew:
            lines.append(draws_line(self.search.drew))
        choice = self.threads_or_processes()
        if choice is not None:
            lines.append(choice)
        slower = self.threads_against_serial()
        if slower is not None:
            lines.append(slower)
        if self.search.thread_safety is not None:
            lines.append(self.search.thread_safety.describe())
        if self.bound == "compute-bound":
            lines.append("the step is the bottleneck: faster loading will not help much.")
        return "\n".join(lines)

    def threads_or_processes(self) -> str | None:
        """Which loaded faster in the search, threads or worker processes (when both ran).

        Both at the search's first depth (2), worker processes meaning ``num_workers > 0``.
        """
        curve = [(s, r) for s, r in self.search.curve if s.depth == 2]
        threads = [(s, r) for s, r in curve if s.threads is not None]
        processes = [(s, r) for s, r in curve if s.threads is None and (s.num_workers or 0) > 0]
        if not threads or not processes:
            return None
        (by_threads, t), (by_processes, p) = (
            max(c, key=lambda sr: sr[1]) for c in (threads, processes)
        )
        ran = (
            f"threads or processes: {by_threads.threads} loading threads ran {t:,.0f} samples/s, "
            f"num_workers={by_processes.num_workers} {p:,.0f} samples/s (one run each in the "
            f"search)"
        )
        if min(t, p) > 0 and max(t, p) / min(t, p) < CLEAR_RATIO:
            # One run each on a shared machine moves by a quarter: no winner to name.
            return f"{ran}: about the same here, no clear difference in one run each."
        faster = "threads" if t > p else "worker processes"
        return f"{ran}: {faster} loaded faster here."

    def threads_against_serial(self) -> str | None:
        """Whether loading threads ran slower than one thread loading alone, in the search.

        The best threads trial against ``num_workers=0`` (nostall's one producer thread, the
        serial loader's work), both at the search's first depth (2), one run each: named
        slower only at :data:`CLEAR_RATIO` or more. Samples that do little work releasing
        the GIL (a ``TensorDataset``, pure-Python code) load several times slower with
        threads, which only contend for the GIL.
        """
        curve = [(s, r) for s, r in self.search.curve if s.depth == 2 and s.num_workers == 0]
        threads = [(s, r) for s, r in curve if s.threads is not None]
        serial = [r for s, r in curve if s.threads is None]
        if not threads or not serial:
            return None
        best, rate = max(threads, key=lambda sr: sr[1])
        one = max(serial)
        if one < CLEAR_RATIO * rate:
            return None
        return (
            f"threads slower than one thread: the best, {best.threads} loading threads, ran "
            f"{rate:,.0f} samples/s, {rate / one:.2f}x the {one:,.0f} samples/s of "
            f"num_workers=0 loading in one thread (one run each in the search). Your samples "
            f"do little work that releases the GIL (a TensorDataset, pure-Python code), so "
            f"threads only contend for it: leave threads= out."
        )

    def to_dict(self) -> dict[str, Any]:
        """Every figure, for ``--json``."""
        setting, rate = self.best
        return {
            "device": self.device,
            "bound": self.bound,
            "load_samples_per_s": self.load.to_dict(),
            "step_samples_per_s": self.step_rate,
            "loop_samples_per_s": self.as_built.to_dict(),
            "best": {"setting": setting.describe(), "samples_per_s": rate.to_dict()},
            "speedup": self.speedup,
            "code": self.code or None,
            "tune": self.search.to_dict(),
            "with_nostall": {
                "setting": self.with_nostall[0].describe(),
                "samples_per_s": self.with_nostall[1].to_dict(),
            },
            "without_nostall": {
                "setting": self.without_nostall[0].describe(),
                "samples_per_s": self.without_nostall[1].to_dict(),
            },
            "summary": self.summary(),
        }

    def to_html(self) -> str:
        """A self-contained page (no scripts, no downloads): the settings, median and spread."""
        measured = [
            ("as built", self.as_built),
            (self.with_nostall[0].describe(), self.with_nostall[1]),
            (self.without_nostall[0].describe(), self.without_nostall[1]),
        ]
        measured += [(f"search: {s.describe()}", Measured((r,))) for s, r in self.search.curve]
        top = max(rate.high for _, rate in measured) or 1.0
        bar_h, width, left = 22, 460, 360
        bars = []
        for i, (label, rate) in enumerate(measured):
            y = i * (bar_h + 6)
            w, lo, hi = (max(1.0, width * v / top) for v in (rate.median, rate.low, rate.high))
            bars.append(
                f'<text x="0" y="{y + 15}" font-size="12">{html.escape(label)}</text>'
                f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar_h}" fill="#3b7dd8"/>'
                f'<line x1="{left + lo:.1f}" x2="{left + hi:.1f}" y1="{y + 11}" y2="{y + 11}" '
                f'stroke="black"/>'
                f'<text x="{left + 5 + hi:.1f}" y="{y + 15}" font-size="12">'
                f"{rate.median:,.0f}</text>"
            )
        height = len(measured) * (bar_h + 6)
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
            for k, v in (
                ("device", self.device),
                ("verdict", self.bound),
                ("load only", _per_s(self.load)),
                ("step only", "n/a" if self.step_rate is None else f"{self.step_rate:,.0f}"),
                ("loop as built", _per_s(self.as_built)),
                ("speed-up", "none measurable" if self.speedup is None else f"{self.speedup:.2f}x"),
            )
        )
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>nostall doctor</title>"
            "<style>body{font-family:sans-serif;margin:2em}td{padding:2px 12px}</style></head>"
            f"<body><h1>nostall doctor</h1><pre>{html.escape(self.summary())}</pre>"
            f"<table>{rows}</table><h2>samples/s: median, and the range of the runs</h2>"
            f"<svg width='{left + width + 80}' height='{height}' "
            f"xmlns='http://www.w3.org/2000/svg'>{''.join(bars)}</svg></body></html>\n"
        )


#: Batches each timed run pulls: two start-up batches, then the timed ones.
RUN_BATCHES = 12


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
        factory: builds the loader (see :mod:`nostall._tune`).
        step: the training step, called with a batch on the device.
        device: where batches go (default: CUDA when available).
        max_batches: the most batches the settings search (:func:`nostall.tune`) may pull; the
            repeated runs around it pull ``4 * repeats * 14`` more, and the step alone one.
        repeats: runs of each compared setting (the loader alone, the loop as built, the best
            found with and without ``nostall.prefetch``); a speed-up is claimed only when
            every run of the best beat every run of the loop as built.
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
    total = 4 * repeats * (RUN_BATCHES + 2) + max_batches
    done = 0

    def say(phase: str) -> None:
        if progress is not None:
            progress(phase, min(done / total, 1.0))

    def rate_of(setting: Setting, phase: str, with_step: bool = True) -> Measured:
        nonlocal done
        runs = []
        for i in range(repeats):
            say(f"{phase} (run {i + 1} of {repeats})")
            rate, used = measure(
                build,
                setting,
                dev,
                batches=RUN_BATCHES,
                step=step if with_step else None,
                transform=transform,
            )
            done += RUN_BATCHES + 2
            if used < 3:
                raise ConfigurationError(_too_few(factory, used))
            runs.append(rate)
        return Measured(tuple(runs))

    load = rate_of(DEFAULT, "load only: the loader as the factory builds it", with_step=False)
    step_rate = None
    if step is not None:
        say("step only: your step on one device-resident batch")
        step_rate = _step_rate(build, step, dev, transform)
    as_built = rate_of(DEFAULT, "the loop as built: loading and step together")

    def trial(setting: Setting, rate: float, spent: int) -> None:
        nonlocal done
        done = 2 * repeats * (RUN_BATCHES + 2) + spent
        say(f"searching settings: {setting.describe()}: {rate:,.0f} samples/s")

    say(f"searching loader settings with nostall.prefetch (at most {max_batches} batches)")
    search = tune(
        build, max_batches=max_batches, device=dev, step=step, transform=transform, on_trial=trial
    )
    done = 2 * repeats * (RUN_BATCHES + 2) + max_batches
    ours = rate_of(search.best, f"again: {search.best.describe()}")
    plain = Setting(search.best.num_workers, None)
    theirs = rate_of(plain, f"again: {plain.describe()}")
    diagnosis = Diagnosis(
        load, step_rate, as_built, search, (search.best, ours), (plain, theirs), str(dev)
    )
    diagnosis.factory_workers = _default_workers(factory)
    diagnosis.code = recommend(
        factory, diagnosis.best[0], dev, transform, search.drew, diagnosis.factory_workers
    )
    done = total
    say("done")
    return diagnosis


def recommend(
    factory: Factory,
    setting: Setting,
    device: Any,
    transform: Any,
    drew: tuple[str, ...] = (),
    factory_workers: int | None = None,
) -> str:
    """The code that builds and feeds the loader with ``setting``, as the user would write it.

    A setting that changes the random draws the model sees (another ``num_workers`` for a
    loader whose dataset or collate_fn draws from a global generator: ``drew``) says so in the
    code itself, in a comment above it.
    """
    name = getattr(factory, "__name__", "make_loader")
    kwargs = ", ".join(f"{k}={v!r}" for k, v in loader_kwargs(factory, setting, device).items())
    lines = []
    workers = setting.num_workers
    if drew and workers is not None and workers != (factory_workers or 0):
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


def draws_line(drew: tuple[str, ...]) -> str:
    """What the doctor says of a loader whose dataset or collate_fn draws from global generators."""
    return (
        f"random draws: your dataset or collate_fn draws from {' and '.join(drew)} at each "
        f"batch. nostall.prefetch loads such a loader in step with your loop (your loop's "
        f"draws, unchanged, but nothing fetched ahead), threads were not tried (they would "
        f"change the draws), and worker processes draw from their own seeds (other values). "
        f"Give the draws a seeded generator of their own (e.g. DataCollatorForLanguageModeling"
        f"(..., seed=0)) to prefetch with the same draws."
    )


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


def _step_rate(build: Factory, step: Step, device: Any, transform: Transform | None) -> float:
    batch = to_device(next(iter(build())), device)
    if transform is not None:
        batch = transform(batch)
    step(batch)  # warm-up
    synchronize(device)
    n = 10
    start = time.perf_counter()
    for _ in range(n):
        step(batch)
    synchronize(device)
    return n * (batch_size_of(batch) or 1) / (time.perf_counter() - start)


def check_output(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before minutes of measuring.

    Writing is tried, not guessed from permission bits (root passes those everywhere, and
    ``/dev/full`` opens fine and fails only when written to):

    * an existing file is opened for appending, without truncating it, and sent a write of
      zero bytes: that changes nothing in a file (nor its time stamps) but fails where a real
      write fails on a device (``/dev/full``: no space) or a read-only filesystem;
    * a new file is tried as a temporary file beside it, one byte written and synced (a full
      or read-only filesystem fails there), then removed: nothing is left behind;
    * a named pipe or socket is not opened: opening a pipe waits for its reader.

    A disk with only a little room left can still fill up before the report is written.

    Raises:
        ConfigurationError: its folder does not exist, it is a folder, or writing it fails.
    """
    if not path:
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigurationError(f"{flag} {path} is a folder; pass a file path")
    if not folder.is_dir():
        raise ConfigurationError(f"{flag} {path}: the folder {folder} does not exist")
    try:
        if not target.exists():
            fd, probe = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".nostall", dir=folder)
            try:
                os.write(fd, b"\0")
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(probe)
        elif not stat.S_ISFIFO(mode := target.stat().st_mode) and not stat.S_ISSOCK(mode):
            fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                os.write(fd, b"")
            finally:
                os.close(fd)
    except OSError as e:
        raise ConfigurationError(
            f"{flag} {path} cannot be written ({e.strerror or e}); pass a path on a writable "
            f"filesystem with room to spare"
        ) from e


def write_reports(diagnosis: Diagnosis, json_path: str | None, html_path: str | None) -> None:
    """Write ``--json`` and ``--html`` where asked."""
    if json_path:
        Path(json_path).write_text(json.dumps(diagnosis.to_dict(), indent=2) + "\n")
    if html_path:
        Path(html_path).write_text(diagnosis.to_html())


def _default_workers(factory: Callable[..., Any]) -> int | None:
    """The ``num_workers`` the factory uses when not given one (None: not an int default)."""
    try:
        default = inspect.signature(factory).parameters["num_workers"].default
    except (KeyError, TypeError, ValueError):
        return None
    return default if isinstance(default, int) and not isinstance(default, bool) else None
