"""Choosing ``num_workers`` and prefetch depth by measuring, in the spirit of tf.data's AUTOTUNE.

The user gives a *factory*: a function that builds their ``DataLoader`` and accepts (some of)
``num_workers``, ``pin_memory``, ``prefetch_factor`` and ``persistent_workers`` as keyword
arguments. Each trial builds a loader with one setting, skips its start-up batches and times a
few more; the search climbs while a step up gains enough, within the CPU budget (cores) and the
memory budget (the one rule of :mod:`nostall._engine.autodepth`: a tenth of the available memory for
batches in flight, at most 64). One trial moves by half on a shared machine, so the search's
leading settings and the loop as built are then measured again, with repeats, alternating, and
the best is chosen on those medians.
"""

from __future__ import annotations

import os
import textwrap
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .. import _arguments
from .._device import DeviceLike, resolve_data_device
from .._engine.autodepth import batch_nbytes, depth_budget
from .._exceptions import ConfigurationError
from .._loading.threadable import check_threadable
from .._sources.global_draws import draws_of
from .._sources.sources import classify
from .._thread_bound import FIX
from ..cuda._timing import Measured
from .thread_safety import ThreadSafety, check_thread_safety
from .trial import LOADER_KNOBS as LOADER_KNOBS
from .trial import YOURS as YOURS
from .trial import Factory as Factory
from .trial import Setting as Setting
from .trial import Step as Step
from .trial import Transform as Transform
from .trial import accepted_knobs as accepted_knobs
from .trial import build as build
from .trial import loader_kwargs as loader_kwargs
from .trial import measure as measure

#: How many of the search's best trials are measured again, with repeats, before one is chosen.
FINALISTS = 2


@dataclass
class TuneResult:
    """What :func:`tune` chose, and every trial it measured (samples/s, in order).

    Invariant: ``samples_per_s`` is ``rate.median``; ``best`` is the setting of ``confirmed``
    with the highest median where the search's leading settings were measured again, else
    (a budget too small, or ``repeats=1``) its fastest single trial.
    """

    best: Setting
    samples_per_s: float
    curve: list[tuple[Setting, float]] = field(default_factory=list)
    batches_spent: int = 0
    #: The check made before trying loading threads (None: threads were not considered).
    thread_safety: ThreadSafety | None = None
    #: The global generators the loader's dataset or collate_fn draws from with
    #: ``num_workers=0`` (its second batch watched): threads are then not tried, and a
    #: recommendation that changes ``num_workers`` changes the draws (see the doctor).
    drew: tuple[str, ...] = ()
    #: The search's leading settings and the loop as built (:data:`YOURS`), measured again
    #: after the search, the same number of runs each, alternating (empty: not measured again).
    confirmed: list[tuple[Setting, Measured]] = field(default_factory=list)

    @property
    def rate(self) -> Measured:
        """The best's samples/s with its spread: its runs measured again, else its one trial."""
        return self.measured(self.best) or Measured((self.samples_per_s,))

    @property
    def yours(self) -> Measured | None:
        """The loop as built, measured beside the leading settings (None: it was not)."""
        return self.measured(YOURS)

    @property
    def speedup(self) -> float | None:
        """The best's median over the loop as built's, when measurably faster, else None.

        Measurably: both measured more than once, and the best's slowest run beat the loop
        as built's fastest (one run has no spread, so it never shows a speed-up).
        """
        yours, rate = self.yours, self.rate
        if yours is None or min(rate.n, yours.n) < 2 or rate.low <= yours.high:
            return None
        return rate.median / yours.median

    def measured(self, setting: Setting) -> Measured | None:
        """The runs of ``setting`` measured again after the search (None: it was not)."""
        return next((rate for s, rate in self.confirmed if s == setting), None)

    def to_dict(self) -> dict[str, Any]:
        """For JSON."""
        safety = self.thread_safety
        return {
            "best": asdict(self.best),
            "samples_per_s": self.samples_per_s,
            "rate": self.rate.to_dict(),
            "yours": None if self.yours is None else self.yours.to_dict(),
            "speedup": self.speedup,
            "batches_spent": self.batches_spent,
            "curve": [{**asdict(s), "samples_per_s": r} for s, r in self.curve],
            "confirmed": [
                {**asdict(s), "yours": s == YOURS, "samples_per_s": r.to_dict()}
                for s, r in self.confirmed
            ],
            "thread_safety": None if safety is None else asdict(safety),
            "drew": list(self.drew),
        }


def tune(
    factory: Factory,
    *,
    max_batches: int = 300,
    device: DeviceLike = None,
    step: Step | None = None,
    max_workers: int | None = None,
    threshold: float = 0.05,
    batches_per_trial: int = 12,
    transform: Transform | None = None,
    on_trial: Callable[[Setting, float, int], None] | None = None,
    repeats: int = 3,
) -> TuneResult:
    """Hill-climb ``num_workers``, loading threads and depth; return the best and the curve.

    Workers go 0, 2, 4, ... up to the CPU budget (``max_workers``, default the core count);
    then, where the loader can be loaded by threads (``nostall.prefetch(threads=...)`` over
    ``num_workers=0``) unless the thread-safety check finds its dataset unsafe (its first
    samples, up to 64, loaded by one thread and then by the most threads tried, came out
    otherwise or raised: see ``result.thread_safety``), and unless it draws from the global
    random generators (``result.drew``: threads would change the draws), threads go 2, 4, ...
    up to twice that
    budget; the best of all keeps its setting while the depth goes 4, 8, ... up to what the
    memory budget holds. Each climb goes on while a step gains at least ``threshold`` (5%).

    One trial is one run, and on a shared machine the same setting moves by half from one run
    to the next: so the search keeps room in ``max_batches`` for measuring again its
    :data:`FINALISTS` fastest settings and the loop as built (:data:`YOURS`), ``repeats`` runs
    each, alternating so that a change in the machine's load falls on all of them alike; the
    best is the finalist with the highest median (``result.rate``, with its spread; the loop
    as built is ``result.yours``). Where ``max_batches`` holds that room (``(FINALISTS + 1) *
    repeats * (batches_per_trial + 2)`` batches) only with fewer than two trials beside it,
    or with ``repeats=1``, nothing is measured again: the best is the fastest single trial,
    and ``result.rate`` holds that one run.

    A trial starts only while it fits in what is left of ``max_batches``, so ``batches_spent <=
    max_batches``, with one exception: the first trial always runs (a result needs one): a
    ``max_batches`` below ``batches_per_trial + 2`` (its start-up and timed batches) spends
    that many anyway. The thread-safety check's samples (four passes, each over a loader
    freshly built) are not counted in ``batches_spent``, nor is the first batch pulled in
    another thread before the first trial (a loader that works only in the thread that built
    it is refused there: no setting with nostall could run).

    Args:
        factory: builds the loader; see the module docstring.
        max_batches: the most batches all trials together may pull from the loaders built.
        device: where batches go (default: CUDA when available).
        step: the training step, when the loop's rate should include it.
        max_workers: the CPU budget: the most ``num_workers`` tried (default: the core count).
        threshold: the smallest relative gain worth another step.
        batches_per_trial: batches timed per trial (after two start-up batches).
        transform: the transform the pipeline applies (``nostall.prefetch(transform=...)``),
            so that the trials measure the pipeline as it runs.
        on_trial: called after each trial with its setting, samples/s and the batches spent
            so far (a progress display, a log); the runs measured again after the search too.
        repeats: runs of each setting measured again after the search (1: none measured
            again; the best is then picked on single trials).

    Raises:
        TypeError: an argument of the wrong type (``factory`` or ``step`` not callable, a count
            that is not an int, a ``threshold`` that is not a number).
        ValueError: a count below its minimum, a negative ``threshold``, ``device='meta'``.
        ConfigurationError: (a ``ValueError``) the loader loads in this thread but raises in
            another, where nostall.prefetch loads it: its dataset works only in the thread that
            built it (an sqlite3 connection made in ``__init__``, say). Checked before the first
            trial on its first batch; the dataset's own error is the ``__cause__``, the
            message says the fix.
    """
    _arguments.function(
        "nostall.tune",
        "factory",
        factory,
        hint="pass the function that builds your loader (make_loader, not make_loader())",
    )
    _arguments.integer("nostall.tune", "max_batches", max_batches, low=1, example=300)
    _arguments.function(
        "nostall.tune", "step", step, optional=True, hint="pass your training step, step(batch)"
    )
    if max_workers is not None:
        _arguments.integer("nostall.tune", "max_workers", max_workers, low=0, example=8)
    gain = _arguments.number("nostall.tune", "threshold", threshold)
    if not gain >= 0:  # NaN fails too: it would end every climb at its first step
        raise ValueError(
            f"nostall.tune(threshold=...) must be a number >= 0 (got threshold={threshold}); "
            f"pass e.g. threshold=0.05, a 5% gain"
        )
    _arguments.integer("nostall.tune", "batches_per_trial", batches_per_trial, low=1, example=12)
    _arguments.function(
        "nostall.tune", "transform", transform, optional=True, hint="pass e.g. a Normalize"
    )
    _arguments.function(
        "nostall.tune", "on_trial", on_trial, optional=True, hint="pass e.g. a logging function"
    )
    _arguments.integer("nostall.tune", "repeats", repeats, low=1, example=3)
    dev = resolve_data_device(device)
    knobs = accepted_knobs(factory)
    cores = max_workers if max_workers is not None else (os.cpu_count() or 1)
    curve: list[tuple[Setting, float]] = []
    spent = 0
    cost = batches_per_trial + 2
    # The room kept for measuring the leading settings (and the loop as built) again, where
    # max_batches holds it beside two trials: a smaller budget is spent on the search alone.
    reserve = (FINALISTS + 1) * repeats * cost if repeats > 1 else 0
    if max_batches < 2 * cost + reserve:
        reserve = 0

    def run(setting: Setting) -> float:
        nonlocal spent
        rate, used = measure(
            factory, setting, dev, batches=batches_per_trial, step=step, transform=transform
        )
        spent += used
        if on_trial is not None:
            on_trial(setting, rate, spent)
        return rate

    def trial(setting: Setting) -> float:
        rate = run(setting)
        curve.append((setting, rate))
        return rate

    def affordable() -> bool:
        return spent + cost + reserve <= max_batches

    # With nostall, num_workers=0 already loads in a background thread, as one worker would: the
    # climb goes 0, 2, 4, ... so that a flat first step does not end it early.
    workers_choices: list[int | None] = [0, *[2**i for i in range(1, 8) if 2**i <= cores]]
    if "num_workers" not in knobs:
        workers_choices = [None]
    best = Setting(workers_choices[0], 2)
    _refuse_if_thread_bound(factory, Setting(workers_choices[0], None), dev)
    best_rate = trial(best)

    def climb(candidates: Iterable[Setting]) -> None:
        """Try each in turn while it gains ``threshold``; keep the best seen."""
        nonlocal best, best_rate
        for candidate in candidates:
            if not affordable():
                return
            rate = trial(candidate)
            gained = rate >= best_rate * (1 + threshold)
            if rate > best_rate:
                best, best_rate = candidate, rate
            if not gained:
                return

    climb(Setting(workers, 2) for workers in workers_choices[1:])
    thread_counts = [2**i for i in range(1, 9) if 2**i <= max(2, 2 * cores)]
    safety = None
    drew = draws_of(build(factory, Setting(0, None), dev)) if "num_workers" in knobs else ()
    if "num_workers" in knobs and affordable() and _threadable(factory, dev):
        # Never recommend threads for a dataset that gives other samples (or errors) under
        # them, nor for one whose draws escape each sample's own generators ("random", drew).
        def fresh() -> Any:
            return build(factory, Setting(0, None), dev)

        safety = check_thread_safety(fresh, thread_counts[-1])
    if safety is not None and not safety.unsafe and not safety.drew:
        # Threads climb from their own start: 2 threads need not beat the best processes.
        previous = 0.0
        for threads in thread_counts:
            if not affordable():
                break
            rate = trial(Setting(0, 2, threads))
            if rate > best_rate:
                best, best_rate = Setting(0, 2, threads), rate
            if rate < previous * (1 + threshold):
                break
            previous = rate
    # Weighing a batch for the depth limit pulls one more: only worth it (and only within
    # max_batches) when a depth trial can follow.
    if spent + 1 + cost + reserve <= max_batches:
        depth_limit = _depth_limit(factory, best, dev)
        spent += 1  # the batch that showed the size
        workers, threads = best.num_workers, best.threads
        climb(Setting(workers, 2**k, threads) for k in range(2, 6) if 2**k <= depth_limit)
    confirmed: list[tuple[Setting, Measured]] = []
    if reserve and spent + reserve <= max_batches:
        confirmed = _measure_again(_finalists(curve), repeats, run)
        best, again = max(
            ((s, r) for s, r in confirmed if s != YOURS), key=lambda pair: pair[1].median
        )
        best_rate = again.median
    return TuneResult(best, best_rate, curve, spent, safety, drew, confirmed)


def _finalists(curve: list[tuple[Setting, float]]) -> list[Setting]:
    """The :data:`FINALISTS` settings of the fastest trials, each once, fastest first."""
    ranked = sorted(curve, key=lambda pair: pair[1], reverse=True)
    return list(dict.fromkeys(s for s, _ in ranked))[:FINALISTS]


def _measure_again(
    finalists: list[Setting], repeats: int, run: Callable[[Setting], float]
) -> list[tuple[Setting, Measured]]:
    """``repeats`` runs of each finalist and of :data:`YOURS`, taking turns.

    Taking turns (A, B, yours, A, B, yours, ...) rather than one setting's runs in a row puts
    a change in the machine's load on every setting alike, so that the medians compare.
    """
    settings = [*finalists, YOURS]
    runs: dict[Setting, list[float]] = {s: [] for s in settings}
    for _ in range(repeats):
        for setting in settings:
            runs[setting].append(run(setting))
    return [(s, Measured(tuple(runs[s]))) for s in settings]


def _refuse_if_thread_bound(factory: Factory, setting: Setting, device: torch.device) -> None:
    """Refuse, before any trial, a loader whose dataset works only in the thread that built it.

    A prefetcher's producer thread calls the dataset of a loader without workers. The trials
    cannot be relied on to show such a dataset: while the producer is idle the loop pulls a
    batch itself, so a trial may load every batch in this thread, and a setting that fails in
    the user's run would be recommended. So the first batch of ``setting``'s loader is pulled
    in another thread first; where that raises and a fresh loader's first batch loads in this
    thread, no setting with nostall can run. Anything else is left to the trials (an error in
    this thread too is the user's code failing, shown by them with its traceback).

    Raises:
        ConfigurationError: the loader works only in this thread (its error is the cause).
    """
    loader = build(factory, setting, device)
    if classify(loader).workers > 0:
        return  # worker processes load it, never a thread of this process
    raised: list[Exception] = []

    def first_batch() -> None:
        try:
            next(iter(loader), None)
        except Exception as e:
            raised.append(e)

    probe = threading.Thread(target=first_batch, name="nostall-tune-probe", daemon=True)
    probe.start()
    probe.join()
    if not raised:
        return
    error = raised[0]
    try:
        next(iter(build(factory, setting, device)), None)
    except Exception:
        return  # it fails in this thread too
    name = getattr(factory, "__name__", "the factory")
    raise ConfigurationError(
        f"the loader that {name}() builds loads in this thread, but raised "
        f"{type(error).__name__} ({textwrap.shorten(str(error), 160)}) in another thread, "
        f"where nostall.prefetch loads it: its dataset holds something that works only in the "
        f"thread that built it (an sqlite3 connection made in __init__, say). To measure or "
        f"prefetch it, {FIX}"
    ) from error


def _threadable(factory: Factory, device: torch.device) -> bool:
    """Whether the loader built with ``num_workers=0`` can be loaded by threads, unchanged.

    Not over an ``IterableDataset``: N threads read it as N worker processes do, which splits
    (or repeats) its items differently for each N, so a thread count would change the data
    and not only how fast it comes; the search compares settings that yield the same batches.
    """
    loader = build(factory, Setting(0, None), device)
    if not classify(loader).map_style:
        return False
    try:
        check_threadable(loader, 2)
    except (TypeError, ValueError):
        return False
    return True


def _depth_limit(factory: Factory, setting: Setting, device: torch.device) -> int:
    """The deepest depth the memory budget allows (the rule ``depth="auto"`` follows)."""
    loader = build(factory, Setting(setting.num_workers, None), device)
    return depth_budget(batch_nbytes(next(iter(loader), None)), device)
