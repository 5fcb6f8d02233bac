"""The report: a rich table per trial, ``Compare``, the conclusion, and ``--check``'s claims.

Every figure is a median with its spread (min-max) over the repeats or the timed blocks. A
ratio is called a gain or a cost only when its whole spread lies on one side of 1. The checks
hold on any machine for a sound install: a failure points at the product, not the machine.
"""

from __future__ import annotations

import io
from typing import NamedTuple

from rich.console import Console
from rich.table import Table
from torch.utils import benchmark

from .._timing import Measured
from ._records import BenchResult

NOSTALL, SERIAL = "nostall", "serial DataLoader"


def format_report(result: BenchResult, width: int = 150) -> str:
    """The whole report as text: tables drawn by rich, micro-benchmarks by ``Compare``."""
    out = io.StringIO()
    console = Console(file=out, width=width, no_color=True, highlight=False)
    m, cfg = result.machine, result.config
    start, end = (f"{result.load_average.get(k, [0.0])[0]:.2f}" for k in ("start", "end"))
    console.print(
        f"nostall bench on {m['device']}{' (' + m['gpu'] + ')' if 'gpu' in m else ''}: torch "
        f"{m['torch']}, {m['cores']} cores ({m['cpu']}), {m['workers']} loader workers, "
        f"{m['compute_threads']} compute threads; load average {start} at the start, "
        f"{end} at the end; {result.seconds:.0f} s. Figures: "
        f"median (min-max) of {cfg.repeats} repeats, the contenders alternating.",
        markup=False,
    )
    for trial, title in (("synthetic", "synthetic images"), ("jpeg", "JPEG files")):
        settings = result.settings(trial)
        if not settings:
            continue
        table = Table(title=f"{title}: x the serial DataLoader's speed; share of the epoch waiting")
        table.add_column("contender")
        for setting in settings:
            serial = result.stat(trial, setting, SERIAL, "samples_per_s")
            head = ("ratio " if trial == "synthetic" else "") + setting
            table.add_column(
                head + f"\nserial {getattr(serial, 'median', 0):,.0f}/s", justify="right"
            )
            table.add_column("waiting", justify="right")
        for name in result.contenders(trial):
            cells = []
            for setting in settings:
                stall = result.stat(trial, setting, name, "stall")
                cells.append(_cell(result.stat(trial, setting, name, "speedup"), ".2f"))
                cells.append("-" if stall is None else f"{stall.median:.0%}")
            table.add_row(name + (" (unsafe)" if name.startswith("seed") else ""), *cells)
        console.print(table)
    table = Table(title="hand-off cost: us per batch over a plain loop")
    for column in ("contender", "us per batch"):
        table.add_column(column)
    for name in result.contenders("handoff"):
        table.add_row(name, _cell(result.stat("handoff", "", name, "us_per_batch"), ".1f"))
    console.print(table)
    if result.measurements:
        console.print("micro-benchmarks (torch.utils.benchmark):")
        console.print(str(benchmark.Compare(result.measurements)), markup=False)
    console.print("conclusion:")
    for sentence in conclusion(result):
        console.print(f"- {sentence}", markup=False)
    return out.getvalue()


def _cell(stat: Measured | None, spec: str) -> str:
    return "-" if stat is None else format(stat, spec)


def _speed(stat: Measured) -> str:
    words = f"{stat.median:.2f}x the serial loader's speed ({stat.low:.2f}-{stat.high:.2f})"
    if stat.below_one:
        return f"{words}: a cost of {1 - stat.median:.0%}"
    return words if stat.exceeds_one else f"{words}, within the noise of 1x"


def conclusion(result: BenchResult) -> list[str]:
    """The run's findings, one sentence each."""
    out, ratios = [], result.settings("synthetic")
    heavy = "1" if "1" in ratios else ratios[-1] if ratios else None
    for setting in ratios:
        speed = result.stat("synthetic", setting, NOSTALL, "speedup")
        removed = result.stat("synthetic", setting, NOSTALL, "wait_removed")
        if speed and removed and setting == heavy:
            out.append(
                f"At load/compute ratio {setting} nostall removed {removed.median:.0%} "
                f"({removed.low:.0%}-{removed.high:.0%}) of the serial loader's waiting and ran "
                f"at {_speed(speed)}."
            )
        elif speed and float(setting) < 1:
            out.append(f"At light load (ratio {setting}) nostall ran at {_speed(speed)}.")
    for setting in result.settings("jpeg"):
        rates = {
            n: result.stat("jpeg", setting, n, "samples_per_s") for n in result.contenders("jpeg")
        }
        best, ours = max(rates, key=lambda n: getattr(rates[n], "median", 0)), rates.get(NOSTALL)
        out.append(
            f"On JPEG files (decode, crop, resize to {setting}) the fastest was {best}, "
            f"{rates[best]:,.0f} samples/s"
            + (f"; nostall {ours:,.0f}." if best != NOSTALL else ".")
        )
    handoff = _handoffs(result)
    if NOSTALL in handoff and len(handoff) > 1:
        best = min((n for n in handoff if n != NOSTALL), key=lambda n: handoff[n].median)
        out.append(
            f"Handing a batch over cost nostall {handoff[NOSTALL].median:.1f} us, the cheapest "
            f"peer ({best}) {handoff[best].median:.1f} us."
        )
    cores = result.machine.get("cores") or 1
    busy = result.load_average.get("start", [0.0])[0]  # at the end it counts the bench too
    if busy > 0.5 * cores:
        out.append(
            f"The machine was busy before the bench began (load average {busy:.1f} on {cores} "
            "cores): other work shared the cores, so spreads are wide and single figures move."
        )
    return out


def _handoffs(result: BenchResult) -> dict[str, Measured]:
    """Each prefetcher's hand-off cost per batch (the serial baseline left out)."""
    stats = {n: result.stat("handoff", "", n, "us_per_batch") for n in result.contenders("handoff")}
    return {n: s for n, s in stats.items() if s is not None and n != SERIAL}


class Check(NamedTuple):
    """A claim ``--check`` holds the run to, whether it held, and the figures behind it."""

    claim: str
    held: bool
    evidence: str


def checks(result: BenchResult) -> list[Check]:
    """The claims this run can test (a trial that did not run tests nothing)."""
    out = []
    speeds = {
        s: result.stat("synthetic", s, NOSTALL, "speedup") for s in result.settings("synthetic")
    }
    if any(speeds.values()):
        out.append(
            Check(
                "nostall is not measurably slower than the serial DataLoader at any ratio",
                not any(s.below_one for s in speeds.values() if s),
                ", ".join(f"ratio {k}: {s:.2f}x" for k, s in speeds.items() if s),
            )
        )
    removed = result.stat("synthetic", "1", NOSTALL, "wait_removed")
    if removed:
        out.append(
            Check(
                "at ratio 1 nostall removes at least half of the serial loader's waiting",
                removed.median >= 0.5,
                f"{removed.median:.0%} ({removed.low:.0%}-{removed.high:.0%})",
            )
        )
    handoff = _handoffs(result)
    if NOSTALL in handoff and len(handoff) > 1:
        ours = handoff.pop(NOSTALL).median
        out.append(
            Check(
                "nostall's hand-off costs less than every peer prefetcher's",
                all(ours < s.median for s in handoff.values()),
                f"nostall {ours:.1f} us; "
                + ", ".join(f"{n} {s.median:.1f} us" for n, s in handoff.items()),
            )
        )
    return out
