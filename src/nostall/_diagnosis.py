"""What ``nostall doctor`` concluded: the measured rates, and the verdict said in words.

A :class:`Diagnosis` holds the figures :func:`nostall._doctor.diagnose` measured, and words its
verdict from them here (the summary, each line of it), so that what the doctor says and the
``--json`` figures are the same numbers. This module measures nothing and writes nothing (see
:mod:`nostall._doctor_report` for the files).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._timing import Measured
from ._tune import Setting, TuneResult

#: Threads against worker processes, one run each: the ratio that names one the faster.
CLEAR_RATIO = 1.25


def per_s(rate: Measured) -> str:
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
        rate = per_s(best)
        step = (
            f", step {self.step_rate:,.0f} samples/s"
            if self.step_rate is not None
            else " (pass --step to compare with your training step)"
        )
        lines = [
            f"{self.bound}: loading {per_s(self.load)}{step}.",
            f"as built, the loop runs at {per_s(self.as_built)}.",
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
