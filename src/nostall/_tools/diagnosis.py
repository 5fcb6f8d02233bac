"""What ``nostall doctor`` concluded: the measured rates, and the verdict said in words.

A :class:`Diagnosis` holds the figures :func:`nostall._tools.doctor.diagnose` measured, and
words its verdict from them here (the summary, each line of it), so that what the doctor says
and the ``--json`` figures are the same numbers. This module measures nothing and writes
nothing (see :mod:`nostall._tools.doctor_report` for the files).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..cuda._timing import Measured
from .tune import Setting, TuneResult

#: Threads against worker processes, one run each: the ratio that names one the faster.
CLEAR_RATIO = 1.25

#: The verdict when the figures cannot decide it: a verdict, not a guess.
BUSY = "too busy to judge"
#: The verdict when loading or the step ran once: one run has no spread to judge by.
ONE_RUN = "cannot tell from one run"
#: Loading and the step within this ratio of each other, all runs included: balanced.
BALANCED_RATIO = 1.25


def per_s(rate: Measured) -> str:
    """A rate as the doctor writes it: "1,100 samples/s (1,000-1,200 over 3 runs)"."""
    return rate.describe(",.0f", "samples/s")


def too_busy(load_average: float | None, cores: int | None) -> bool:
    """More runnable processes than cores, on average over the last minute.

    Then the loader, the step and every other process take turns on the cores, and how much
    each gets moves from one run to the next: the bench's figures moved 4-13x at load 4-7 on
    2 cores.
    """
    return load_average is not None and cores is not None and load_average > cores


def bound(
    load: Measured,
    step: Measured | None,
    loops: Iterable[Measured],
    load_average: float | None = None,
    cores: int | None = None,
) -> str:
    """input-bound, compute-bound, balanced, or why it cannot be said; from the figures alone.

    ``load`` is loading alone, ``step`` the step alone, ``loops`` every rate measured with
    the step in the loop (samples/s). The verdict follows from these figures:

    * no step: unknown;
    * figures that contradict each other (a loop with the step in it ran faster, all runs,
      than the step alone: the load moved them between measurements): :data:`BUSY`;
    * loading or the step measured once: :data:`ONE_RUN` (no spread to judge by);
    * loading slower than the step, every run, and by more than a tenth (medians):
      input-bound; faster: compute-bound; within a tenth: balanced. On any machine, however
      busy: runs that fall apart, all of them, were measured under the same load;
    * the spreads overlap: on a machine :func:`too_busy`, :data:`BUSY` (the load may be
      what brought them together); else balanced where every run of both lies within
      :data:`BALANCED_RATIO` of every other, else :data:`BUSY` (the spread is wider than
      the difference it would have to show).
    """
    if step is None:
        return "unknown (no --step given)"
    if any(loop.low > step.high for loop in loops):
        return BUSY
    if min(load.n, step.n) < 2:
        return ONE_RUN
    ratio = load.median / step.median if step.median > 0 else float("inf")
    if load.high < step.low:
        return "input-bound" if ratio < 0.9 else "balanced"
    if load.low > step.high:
        return "compute-bound" if ratio > 1.1 else "balanced"
    if too_busy(load_average, cores):
        return BUSY
    least = min(load.low, step.low)
    if least > 0 and max(load.high, step.high) <= BALANCED_RATIO * least:
        return "balanced"
    return BUSY


@dataclass
class Diagnosis:
    """What the doctor measured and concluded (samples/s throughout).

    Invariant: ``speedup`` is None unless both the best setting and the loop as built ran
    more than once and the best's slowest run beat the loop's fastest (the spreads do not
    overlap); then it is the ratio of the medians, > 1. ``bound`` follows from the figures
    printed beside it (see :func:`bound`).
    """

    load: Measured
    step_rate: Measured | None
    as_built: Measured
    search: TuneResult
    with_nostall: tuple[Setting, Measured]
    without_nostall: tuple[Setting, Measured]
    device: str
    code: str = ""  # the change to make, as code (empty when nothing is measurably faster)
    #: The factory's own num_workers (its default), when it has one: the loop as built uses it.
    factory_workers: int | None = None
    #: The highest one-minute load average seen while measuring (None: not known here).
    load_average: float | None = None
    #: The machine's cores (None: not known).
    cores: int | None = None
    #: The intra-op threads (torch.get_num_threads()) the step ran with, as in the user's loop.
    threads: int | None = None

    @property
    def loops(self) -> tuple[Measured, ...]:
        """Every rate measured with the step in the loop."""
        return (self.as_built, self.with_nostall[1], self.without_nostall[1])

    @property
    def bound(self) -> str:
        """The verdict (:func:`bound`): input-bound, compute-bound, balanced, or why not said."""
        return bound(self.load, self.step_rate, self.loops, self.load_average, self.cores)

    @property
    def best(self) -> tuple[Setting, Measured]:
        """The fastest setting found (by median), with or without nostall."""
        return max(self.with_nostall, self.without_nostall, key=lambda pair: pair[1].median)

    @property
    def speedup(self) -> float | None:
        """The best setting's median over the loop as built, when measurably faster, else None."""
        rate = self.best[1]
        if min(rate.n, self.as_built.n) < 2 or rate.low <= self.as_built.high:
            return None
        return rate.median / self.as_built.median

    def machine_line(self) -> str | None:
        """The load the figures were measured under, and whether it was too much to judge."""
        if self.load_average is None:
            return None
        cores = "" if self.cores is None else f" on {self.cores} cores"
        threads = "" if self.threads is None else f"; the step ran with {self.threads} threads"
        line = f"machine: load average up to {self.load_average:.1f}{cores}{threads}."
        if not too_busy(self.load_average, self.cores):
            return line
        verdict = self.bound
        if verdict == BUSY:
            return line + (
                " More processes wanted the cores than there are: every figure here moves with "
                "them, too much to judge which is slower; run again when the machine is quieter."
            )
        if verdict in ("input-bound", "compute-bound", "balanced"):
            return line + (
                " More processes wanted the cores than there are, so every figure moves with "
                "them; but every run of loading alone fell apart from every run of the step "
                f"alone, so the verdict ({verdict}) holds under this load (which may slow "
                "loading more than the step: on a quieter machine the gap may be smaller)."
            )
        return line + " More processes wanted the cores than there are: the figures move."

    def contradiction(self) -> str | None:
        """A loop with the step in it measured faster than the step alone, if one was."""
        step = self.step_rate
        if step is None:
            return None
        fastest = max(self.loops, key=lambda rate: rate.low)
        if fastest.low <= step.high:
            return None
        return (
            f"too busy to judge: a loop with your step in it ran at {per_s(fastest)}, faster "
            f"than the step alone ({per_s(step)}), which cannot be: the machine's load moved "
            f"the figures between measurements; run again when it is quieter."
        )

    def comparison(self) -> list[str]:
        """The best found against the loop as built, as each figure allows it to be said."""
        setting, best = self.best
        rate = per_s(best)
        speedup = self.speedup
        if speedup is not None:
            return [
                f"measurably faster: {setting.describe()}, {rate}: {speedup:.2f}x yours.",
                f"change your code to:\n{self.code}",
            ]
        yours = setting.depth is None and setting.num_workers in (None, self.factory_workers)
        if yours:
            found = f"the best found is your loop as built ({setting.describe()}), at {rate}"
            return [f"no setting is measurably faster: {found}."]
        if min(best.n, self.as_built.n) < 2:
            return [
                f"cannot tell from one run whether {setting.describe()} ({rate}) is faster "
                f"than your loop as built: one run has no spread; pass --repeats 3 or more."
            ]
        if best.high < self.as_built.low:
            return [
                f"your loop as built is the best found: no setting tried ran as fast; the "
                f"fastest other, {setting.describe()}, ran at {rate}, slower than yours."
            ]
        return [
            f"no setting is measurably faster: the best found, {setting.describe()}, ran at "
            f"{rate}, within the spread of yours."
        ]

    def summary(self) -> str:
        """The diagnosis in plain words, ending with the code change when there is one.

        Every claim follows from a figure printed in it: the verdict from loading and the step
        (:func:`bound`), a speed-up from spreads that do not overlap, "the step is the
        bottleneck" only where no loop ran faster than the step.
        """
        step = (
            f", step alone {per_s(self.step_rate)}"
            if self.step_rate is not None
            else " (pass --step to compare with your training step)"
        )
        verdict = self.bound
        lines = [
            f"{verdict}: loading alone {per_s(self.load)}{step}.",
            f"as built, the loop runs at {per_s(self.as_built)}.",
        ]
        for line in (self.machine_line(), self.contradiction()):
            if line is not None:
                lines.append(line)
        lines += self.comparison()
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
        if verdict == "compute-bound":
            lines.append(
                "the step is the bottleneck: loading alone ran faster than the step alone, so "
                "beyond loading while the step runs, faster loading will not help."
            )
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
            "step_samples_per_s": None if self.step_rate is None else self.step_rate.to_dict(),
            "step_threads": self.threads,
            "load_average": self.load_average,
            "cores": self.cores,
            "loop_samples_per_s": self.as_built.to_dict(),
            "best": {"setting": setting.describe(), "samples_per_s": rate.to_dict()},
            "speedup": self.speedup,
            # Only a change measurably faster than the loop as built is one to make.
            "code": (self.code or None) if self.speedup is not None else None,
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
        f"batch. nostall.prefetch without threads loads such a loader in step with your loop "
        f"(your loop's draws, unchanged, but nothing fetched ahead); under threads= each "
        f"sample draws from a generator of its own (in parallel and reproducible, other "
        f"values), as worker processes draw from their own seeds. "
        f"Give the draws a seeded generator of their own (e.g. DataCollatorForLanguageModeling"
        f"(..., seed=0)) to prefetch with the same draws."
    )
