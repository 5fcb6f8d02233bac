"""Knowing your stalls: how long each training step waits for its batch.

``nostall.profile(loader)`` wraps any iterable and yields the same batches; ``report()`` says how
much of the loop was spent waiting for data, with TensorFlow's profiler thresholds as the verdict.
Host waits are measured on the host. On CUDA, the time the GPU sat idle between steps is measured
with events on the consumer's stream, since the host may wait while the GPU still works through
queued kernels (a wait that costs nothing) or the GPU may idle while the host is busy elsewhere.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import torch

from .. import _arguments as check
from .._device import DeviceLike, resolve_device
from ..cuda._tree import batch_size_of

T = TypeVar("T")

#: TensorFlow's profiler thresholds: under 5% of step time waiting is not input-bound, 5-20% is
#: moderately input-bound, 20% or more highly.
MODERATE, HIGH = 0.05, 0.20


def stall_fraction(wait_s: float, loop_s: float) -> float:
    """The share of a loop's time spent blocked waiting for the next batch (0 for no loop)."""
    return wait_s / loop_s if loop_s > 0 else 0.0


@dataclass(frozen=True)
class StallReport:
    """How much of a loop was spent waiting for data.

    Attributes:
        batches: batches handed out.
        wait_s: total seconds the consumer was blocked in ``next()``.
        loop_s: seconds from the first ``next()`` to the end of the last one (all epochs).
        startup_wait_s: the part of ``wait_s`` spent waiting for each iteration's first batch
            (the loader's start: its iterator, worker processes if it has any, the first
            fetch): paid once per epoch, not per step.
        iterations: iterations (epochs) that handed out at least one batch.
        wait_p50_s, wait_p90_s, wait_p99_s, wait_max_s: percentiles of the steady waits, for
            the batches after each iteration's first.
        interval_p50_s, interval_p90_s: percentiles of the time between consecutive batches
            (a step and its wait), within iterations.
        samples: samples handed out, when batch sizes could be read (a tensor's first
            dimension), else None.
        gpu_idle_s: on CUDA, seconds the consumer's stream sat idle waiting for batches
            (measured with events), else None.
        rank: this process's rank under ``torch.distributed``, else None.
        ranks: with ``report(all_ranks=True)``, every rank's report as a dict, by rank.
    """

    batches: int = 0
    wait_s: float = 0.0
    loop_s: float = 0.0
    startup_wait_s: float = 0.0
    iterations: int = 0
    wait_p50_s: float = 0.0
    wait_p90_s: float = 0.0
    wait_p99_s: float = 0.0
    wait_max_s: float = 0.0
    interval_p50_s: float = 0.0
    interval_p90_s: float = 0.0
    samples: int | None = None
    gpu_idle_s: float | None = None
    rank: int | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stall_fraction(self) -> float:
        """The share of the loop spent waiting for data (see :func:`stall_fraction`)."""
        return stall_fraction(self.wait_s, self.loop_s)

    @property
    def steady_stall_fraction(self) -> float:
        """The share of the loop spent waiting, each iteration's first batch left out.

        What a longer run converges to: the start-up wait is paid once per epoch.
        """
        startup = self.startup_wait_s
        return stall_fraction(self.wait_s - startup, self.loop_s - startup)

    @property
    def samples_per_s(self) -> float | None:
        """Throughput over the loop, when the batch sizes are known."""
        if self.samples is None or self.loop_s <= 0:
            return None
        return self.samples / self.loop_s

    @property
    def verdict(self) -> str:
        """TensorFlow's wording (not, moderately or highly input-bound), for the steady state."""
        fraction = self.steady_stall_fraction
        if fraction < MODERATE:
            return "not input-bound"
        if fraction < HIGH:
            return "moderately input-bound"
        return "highly input-bound"

    @property
    def next_step(self) -> str:
        """What to do about the verdict, in a line."""
        fraction = self.steady_stall_fraction
        if fraction < MODERATE:
            return (
                "none for loading: the loop waits little for data; if the run is still slow, "
                "time the step itself (torch.profiler)"
            )
        return (
            f"{'load faster' if fraction >= HIGH else 'worth a try'}: more workers "
            f"(DataLoader num_workers=) or loading threads (threads=), found for your loader "
            f"by `nostall tune`; `nostall doctor` says where the time goes"
        )

    @property
    def slowest_rank(self) -> int | None:
        """With every rank's figures: the rank that waited longest for data."""
        if not self.ranks:
            return None
        return int(max(self.ranks, key=lambda r: r["wait_s"])["rank"])

    def to_dict(self) -> dict[str, Any]:
        """Every figure, derived ones included, for logging."""
        out = asdict(self)
        out.update(
            stall_fraction=self.stall_fraction,
            steady_stall_fraction=self.steady_stall_fraction,
            samples_per_s=self.samples_per_s,
            verdict=self.verdict,
            next_step=self.next_step,
            slowest_rank=self.slowest_rank,
        )
        return out

    def __str__(self) -> str:
        rows = [
            ("batches", f"{self.batches}"),
            ("loop", f"{self.loop_s:.3f} s"),
            ("waiting for data", f"{self.wait_s:.3f} s ({self.stall_fraction:.1%})"),
            (
                "  for each epoch's first batch",
                f"{self.startup_wait_s:.3f} s over {self.iterations} "
                f"iteration{'s' if self.iterations != 1 else ''} (the loader's start, once an "
                f"epoch)",
            ),
            (
                "  after it (steady state)",
                f"{self.wait_s - self.startup_wait_s:.3f} s ({self.steady_stall_fraction:.1%})",
            ),
            (
                "steady wait per batch p50 / p90 / p99 / max",
                " / ".join(
                    f"{v * 1e3:.2f}"
                    for v in (self.wait_p50_s, self.wait_p90_s, self.wait_p99_s, self.wait_max_s)
                )
                + " ms",
            ),
        ]
        rows.append(
            (
                "time between batches p50 / p90",
                f"{self.interval_p50_s * 1e3:.2f} / {self.interval_p90_s * 1e3:.2f} ms",
            )
        )
        if self.samples_per_s is not None:
            rows.append(("samples/s", f"{self.samples_per_s:,.0f}"))
        if self.gpu_idle_s is not None:
            rows.append(("GPU idle between steps", f"{self.gpu_idle_s:.3f} s"))
        rows.append(("verdict", self.verdict))
        rows.append(("next step", self.next_step))
        for r in self.ranks:
            mark = "  <- slowest" if r["rank"] == self.slowest_rank else ""
            rows.append(
                (
                    f"rank {r['rank']}",
                    f"waited {r['wait_s']:.3f} s of {r['loop_s']:.3f} s "
                    f"({r['stall_fraction']:.1%}){mark}",
                )
            )
        width = max(len(name) for name, _ in rows)
        title = "nostall stall report" + (f" (rank {self.rank})" if self.rank is not None else "")
        return "\n".join([title, *(f"  {name:<{width}}  {value}" for name, value in rows)])


class StallRecorder:
    """Collects per-batch waits; used by :func:`profile` and by ``prefetch(profile=True)``.

    Not thread-safe: one consumer thread records. The cost per batch is two clock reads, and on
    CUDA two event records. Loop time adds up each iteration from its first ``next()`` to its
    end, so time between epochs (validation, checkpoints) does not count. On CUDA, pairs of
    events whose second event has completed are folded into a running sum (checked without
    waiting, every ``FOLD_EVERY`` batches), so a long run holds a bounded number of events.
    """

    #: Pending event pairs above which completed ones are folded into the sum.
    FOLD_EVERY = 64

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waits: list[float] = []  # after each iteration's first batch
        self.first_waits: list[float] = []  # each iteration's first batch
        self.intervals: list[float] = []
        self._last_arrival: float | None = None
        self.samples: int | None = 0
        self._closed_s = 0.0  # loop time of the iterations that ended
        self._open_s = 0.0  # loop time so far of the one running
        self._start: float | None = None
        self._wait_start = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._idle_ms = 0.0  # GPU idle of the pairs already folded
        self._folded = False
        self._step_end: torch.cuda.Event | None = None

    @property
    def loop_s(self) -> float:
        """Seconds of loop recorded so far."""
        return self._closed_s + self._open_s

    def before_next(self) -> None:
        """The consumer asks for a batch."""
        now = time.perf_counter()
        if self._start is None:
            self._start = now
        self._wait_start = now
        if self.device.type == "cuda":
            # Completes when the GPU has finished what the previous step queued.
            self._step_end = _event(self.device)

    def after_next(self, batch: Any) -> None:
        """The consumer got ``batch``."""
        now = time.perf_counter()
        if self._last_arrival is None:
            self.first_waits.append(now - self._wait_start)  # this iteration's first batch
        else:
            self.waits.append(now - self._wait_start)
            self.intervals.append(now - self._last_arrival)
        self._last_arrival = now
        self._open_s = now - (self._start if self._start is not None else now)
        if self._step_end is not None:
            self._events.append((self._step_end, _event(self.device)))
            self._step_end = None
            if len(self._events) >= self.FOLD_EVERY:
                self._fold(wait=False)
        if self.samples is not None:
            size = batch_size_of(batch)
            self.samples = None if size is None else self.samples + size

    def end(self) -> None:
        """The iteration ended (its end of data or an error)."""
        if self._start is not None:
            self._closed_s += time.perf_counter() - self._start
        self._start, self._open_s, self._step_end = None, 0.0, None
        self._last_arrival = None

    def _fold(self, wait: bool) -> None:
        """Add the idle time of completed event pairs to the sum and drop them, oldest first.

        Events on one stream complete in order, so the first pending pair that has not
        completed ends the folding; with ``wait`` the last pair is waited for first.
        """
        if wait and self._events:
            self._events[-1][1].synchronize()
        done = 0
        for start, stop in self._events:
            if not stop.query():  # type: ignore[no-untyped-call]
                break
            self._idle_ms += start.elapsed_time(stop)
            done += 1
        if done:
            del self._events[:done]
            self._folded = True

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self.__init__(self.device)  # type: ignore[misc]

    def report(self, *, all_ranks: bool = False) -> StallReport:
        """The figures so far; with ``all_ranks``, gathered from every rank (a collective call)."""
        waits = sorted(self.waits)
        intervals = sorted(self.intervals)
        gpu_idle = None
        if self._events or self._folded:
            self._fold(wait=True)
            gpu_idle = self._idle_ms / 1e3
        startup = sum(self.first_waits)
        batches = len(waits) + len(self.first_waits)
        report = StallReport(
            batches=batches,
            wait_s=sum(waits) + startup,
            loop_s=self.loop_s,
            startup_wait_s=startup,
            iterations=len(self.first_waits),
            wait_p50_s=_percentile(waits, 0.50),
            wait_p90_s=_percentile(waits, 0.90),
            wait_p99_s=_percentile(waits, 0.99),
            wait_max_s=waits[-1] if waits else 0.0,
            interval_p50_s=_percentile(intervals, 0.50),
            interval_p90_s=_percentile(intervals, 0.90),
            samples=self.samples if batches else None,
            gpu_idle_s=gpu_idle,
            rank=_rank(),
        )
        return _gather(report) if all_ranks else report


class Profiled(Generic[T]):
    """An iterable that yields ``source``'s batches unchanged and records how long each took."""

    def __init__(self, source: Iterable[T], device: torch.device) -> None:
        self.source = source
        self.recorder = StallRecorder(device)

    def __iter__(self) -> Iterator[T]:
        recorder = self.recorder
        it = iter(self.source)
        try:
            while True:
                recorder.before_next()
                try:
                    batch = next(it)
                except StopIteration:
                    return
                recorder.after_next(batch)
                yield batch
        finally:
            recorder.end()  # the end of data, an error, or a loop left early

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def report(self, *, all_ranks: bool = False) -> StallReport:
        """See :meth:`StallRecorder.report`."""
        return self.recorder.report(all_ranks=all_ranks)

    def reset(self) -> None:
        """Start counting afresh (e.g. after warm-up)."""
        self.recorder.reset()


def profile(source: Iterable[T], device: DeviceLike = None) -> Profiled[T]:
    """Wrap ``source`` to measure how long the loop waits for each batch.

    The batches are yielded unchanged. ``wrapper.report()`` returns a :class:`StallReport`.
    ``device`` is the device the step runs on (default: CUDA when available); on CUDA the GPU's
    idle time between steps is measured too.
    """
    check.source(source, "nostall.profile")
    return Profiled(source, resolve_device(device))


def _event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(device))
    return event


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    if len(sorted_values) == 1:
        return sorted_values[0]
    return float(statistics.quantiles(sorted_values, n=100, method="inclusive")[round(q * 100) - 1])


def _rank() -> int | None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def _gather(report: StallReport) -> StallReport:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        mine = {**report.to_dict(), "rank": 0}
        return StallReport(**{**asdict(report), "ranks": [_brief(mine)]})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, _brief(report.to_dict()))
    return StallReport(**{**asdict(report), "ranks": sorted(gathered, key=lambda r: r["rank"])})


def _brief(figures: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "rank",
        "batches",
        "wait_s",
        "startup_wait_s",
        "loop_s",
        "stall_fraction",
        "steady_stall_fraction",
        "samples_per_s",
        "verdict",
    )
    return {k: figures[k] for k in keys}
