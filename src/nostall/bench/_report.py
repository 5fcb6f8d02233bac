"""The report: a rich table per trial, ``Compare``, the conclusion, and ``--check``'s claims.

Every figure is a median with its spread (min-max) over the repeats or the timed blocks; a
figure of one run is shown alone with "n=1" (a range needs two). A ratio is called a gain or a
cost only when its whole spread lies on one side of 1, and a contender the fastest only when
its spread clears every other's. A hand-off cost is a difference of two timings: where its
spread reaches 0 it is within the plain loop's noise and is shown as a bound, never negative.
The checks hold for a sound install on a machine that is not busy: on a busy one (see
:func:`too_busy`) they are not judged, so that a failure points at the product, not the machine.
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

from rich.console import Console
from rich.table import Table
from torch.utils import benchmark

from ..cuda._timing import Measured
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
        f"{m['torch']}, {m['cores']} cores ({m['cpu']}), {m.get('usable_cores', m['cores'])} "
        f"usable, {_count(m['workers'], 'loader worker')}, "
        f"{m.get('loading_threads', '?')} loading threads, {m['compute_threads']} compute "
        f"threads; load average {start} at the start, "
        f"{end} at the end; {result.seconds:.0f} s. Figures: "
        f"median (min-max) of {cfg.repeats} repeats, the contenders alternating.",
        markup=False,
    )
    _regime_table(console, result)
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
                speedup = result.stat(trial, setting, name, "speedup")
                # The serial loader is the yardstick: its 1.00 (1.00-1.00) is no measurement.
                cells.append("baseline" if name == SERIAL else figure(speedup, ".2f"))
                cells.append("-" if stall is None else f"{stall.median:.0%}")
            table.add_row(name + (" (unsafe)" if name.startswith("seed") else ""), *cells)
        console.print(table)
    table = Table(title="hand-off cost: us per batch over a plain loop")
    for column in ("contender", "us per batch"):
        table.add_column(column)
    for name in result.contenders("handoff"):
        stat = result.stat("handoff", "", name, "us_per_batch")
        table.add_row(name, "baseline" if name == SERIAL else handoff_figure(stat))
    console.print(table)
    _convoy_table(console, result)
    if result.measurements:
        console.print("micro-benchmarks (torch.utils.benchmark):")
        console.print(str(benchmark.Compare(result.measurements)), markup=False)
    console.print("conclusion:")
    for sentence in conclusion(result):
        console.print(f"- {sentence}", markup=False)
    return out.getvalue()


REGIME = "gpu regime"
#: The GPU-regime table's columns: metric, heading, format.
_REGIME_COLUMNS = (
    ("efficiency", "x device time", ".2f"),
    ("samples_per_s", "samples/s", ",.0f"),
    ("stall", "waiting", ".0%"),
    ("first_batch_ms", "first batch ms", ",.0f"),
    ("memory_mib", "memory added MiB", ".1f"),
    ("launch_slowdown", "launch slowdown x", ".2f"),
)


def _regime_table(console: Console, result: BenchResult) -> None:
    """The headline: each contender's epoch time over the device's, where the step waits for it."""
    for setting in result.settings(REGIME):
        alone = result.stat("step", REGIME, "launch alone", "ms")
        table = Table(
            title=f"GPU regime, JPEG loading: each step launches ({figure(alone, '.1f')} ms "
            f"alone), then waits without the GIL until {setting} of device time has passed; "
            "each epoch's time over the device's own time: 1 where the device never waited"
        )
        table.add_column("contender")
        for _, head, _ in _REGIME_COLUMNS:
            table.add_column(head, justify="right")
        for name in result.contenders(REGIME):
            cells = [
                figure(result.stat(REGIME, setting, name, m), f) for m, _, f in _REGIME_COLUMNS
            ]
            table.add_row(name, *cells)
        console.print(table)


def figure(stat: Measured | None, spec: str) -> str:
    """A cell: "1.25 (1.20-1.30)"; one run alone "1.25 (n=1)", never a range of zero width."""
    if stat is None:
        return "-"
    return f"{stat.median:{spec}} (n=1)" if stat.n == 1 else format(stat, spec)


def _range(stat: Measured, spec: str) -> str:
    """The spread in words' brackets: "1.20-1.30", or "n=1" for a single run."""
    return "n=1" if stat.n == 1 else f"{stat.low:{spec}}-{stat.high:{spec}}"


def handoff_figure(stat: Measured | None) -> str:
    """A hand-off cost in us: its figure, or a bound where the spread reaches 0.

    Each run is a loop's time less the plain loop's median, so noise in either can make it
    negative: a cost whose least run is 0 or below is not told apart from the plain loop's.
    """
    if stat is None:
        return "-"
    if stat.low <= 0:
        return f"within noise (at most {max(stat.high, 0.0):.1f})"
    return figure(stat, ".1f")


def _speed(stat: Measured) -> str:
    words = f"{stat.median:.2f}x the serial loader's speed ({_range(stat, '.2f')})"
    if stat.below_one:
        # Below 1 in every run, by less than half a percent at the median: say so, not "0%".
        cost = 1 - stat.median
        return f"{words}: a cost of {cost:.0%}" if cost >= 0.005 else f"{words}: a cost below 1%"
    return words if stat.exceeds_one else f"{words}, within the noise of 1x"


def _count(n: Any, noun: str) -> str:
    """``1 loader worker``, ``2 loader workers``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def fastest(stats: dict[str, Measured], higher: bool = True) -> list[str]:
    """The contender with the best median, with every other whose spread reaches its own.

    Best is the highest (``higher``) or the lowest. One name: the best, clear of the others;
    several: tied within the spread (a figure of one run has no spread, so it is tied with any
    whose range holds it).
    """
    if higher:
        best = max(stats, key=lambda n: stats[n].median)
        return [n for n in stats if n == best or stats[n].high >= stats[best].low]
    best = min(stats, key=lambda n: stats[n].median)
    return [n for n in stats if n == best or stats[n].low <= stats[best].high]


def _regime_findings(result: BenchResult) -> list[str]:
    """The GPU regime: who came closest to the device-bound limit, and the launch's slowdown."""
    out = []
    for setting in result.settings(REGIME):
        e = {
            n: s
            for n in result.contenders(REGIME)
            if (s := result.stat(REGIME, setting, n, "efficiency")) is not None
        }
        top = fastest(e, higher=False)
        where = f"In the GPU regime ({setting} of device time per step)"
        if len(top) == 1:
            out.append(
                f"{where} {top[0]} came closest to the limit: its epochs took "
                f"{figure(e[top[0]], '.2f')} times the device's own time."
            )
        else:
            out.append(f"{where} {_list(top)} came closest to the limit, tied within the spread.")
        ours = [n for n in e if n.startswith(NOSTALL)]
        if ours:
            best = min(ours, key=lambda n: e[n].median)
            out.append(
                f"nostall's best setting there was {best}: its epochs took "
                f"{figure(e[best], '.2f')} times the device's own time."
            )
        slow = {
            n: s
            for n in result.contenders(REGIME)
            if (s := result.stat(REGIME, setting, n, "launch_slowdown")) is not None
        }
        threads = [n for n in slow if "threads=" in n]
        workers = [n for n in slow if n in ("best-practice DataLoader", "nostall + workers")]
        if threads and workers:
            out.append(
                "Beside loading, the launch phase took "
                + ", ".join(f"{figure(slow[n], '.2f')}x its time alone with {n}" for n in threads)
                + "; with worker processes "
                + ", ".join(f"{figure(slow[n], '.2f')}x ({n})" for n in workers)
                + "."
            )
    return out


def conclusion(result: BenchResult) -> list[str]:
    """The run's findings, one sentence each."""
    out, ratios = _regime_findings(result), result.settings("synthetic")
    heavy = "1" if "1" in ratios else ratios[-1] if ratios else None
    for setting in ratios:
        speed = result.stat("synthetic", setting, NOSTALL, "speedup")
        removed = result.stat("synthetic", setting, NOSTALL, "wait_removed")
        if speed and removed and setting == heavy:
            out.append(
                f"At load/compute ratio {setting} nostall removed {removed.median:.0%} "
                f"({_range(removed, '.0%')}) of the serial loader's waiting and ran "
                f"at {_speed(speed)}."
            )
        elif speed and float(setting) < 1:
            out.append(f"At light load (ratio {setting}) nostall ran at {_speed(speed)}.")
    for setting in result.settings("jpeg"):
        rates = {
            n: s
            for n in result.contenders("jpeg")
            if (s := result.stat("jpeg", setting, n, "samples_per_s")) is not None
        }
        if not rates:
            continue
        top, ours = fastest(rates), rates.get(NOSTALL)
        size, _, augmented = setting.partition(" ")
        drawn = ", random crops and flips from torch's global generator" if augmented else ""
        what = f"On JPEG files (decode, crop, resize to {size}{drawn})"
        if len(top) == 1:
            words = f"{what} the fastest was {top[0]}, {figure(rates[top[0]], ',.0f')} samples/s"
        else:
            words = f"{what} no contender was fastest: {_list(top)} tied within the spread"
        out.append(
            words + (f"; nostall {figure(ours, ',.0f')}." if ours and top != [NOSTALL] else ".")
        )
    handoff = _handoffs(result)
    if NOSTALL in handoff and len(handoff) > 1:
        best = min((n for n in handoff if n != NOSTALL), key=lambda n: handoff[n].median)
        mine, theirs = handoff_figure(handoff[NOSTALL]), handoff_figure(handoff[best])
        out.append(
            f"Handing a batch over cost nostall {mine} us, the cheapest peer ({best}) {theirs} us."
        )
    verdict = convoy_verdict(result)
    if verdict is not None:
        out.append(verdict)
    cores = result.machine.get("cores") or 1
    busy = result.load_average.get("start", [0.0])[0]  # at the end it counts the bench too
    if busy > 0.5 * cores:
        out.append(
            f"The machine was busy before the bench began (load average {busy:.1f} on {cores} "
            "cores): other work shared the cores, so spreads are wide and single figures move."
        )
    return out


def _convoy_table(console: Console, result: BenchResult) -> None:
    """The hand-off with GIL-free calls on both threads: us per batch per case."""
    settings = result.settings("convoy")
    if not settings:
        return
    table = Table(
        title="hand-off with GIL-free calls on both threads, as on a GPU: us per batch "
        f"({result.machine.get('convoy_calls', 'spin')})"
    )
    for column in ("source us", "step us", "K", "ideal"):
        table.add_column(column, justify="right")
    names = result.contenders("convoy")
    for name in names:
        table.add_column(name, justify="right")
    for setting in settings:
        source_us, step_us, k = setting.split(",")
        ideal = max(float(source_us), float(step_us))
        cells = [figure(result.stat("convoy", setting, n, "us_per_batch"), ".1f") for n in names]
        table.add_row(source_us, step_us, k, f"{ideal:g}", *cells)
    console.print(table)


def convoy_verdict(result: BenchResult) -> str | None:
    """In how many convoy cases nostall took at most the plain loop's and the seed's time."""
    settings = result.settings("convoy")
    if not settings:
        return None
    won, cases = 0, []
    for setting in settings:
        stats = {
            n: result.stat("convoy", setting, n, "us_per_batch")
            for n in result.contenders("convoy")
        }
        ours = stats.pop(NOSTALL, None)
        if ours is None or not stats:
            return None
        best = min(s.median for s in stats.values() if s is not None)
        won += ours.median <= best
        cases.append(f"{ours.median / best:.2f}x")
    return (
        f"With GIL-free calls on both threads (as on a GPU), nostall took at most the time of "
        f"the better of the plain loop and the seed's thread in {won} of {len(settings)} cases "
        f"(nostall over that better one, by case: {', '.join(cases)})."
    )


def _handoffs(result: BenchResult) -> dict[str, Measured]:
    """Each prefetcher's hand-off cost per batch (the serial baseline left out)."""
    stats = {n: result.stat("handoff", "", n, "us_per_batch") for n in result.contenders("handoff")}
    return {n: s for n, s in stats.items() if s is not None and n != SERIAL}


def too_busy(result: BenchResult) -> str | None:
    """Why the run cannot be judged, or None: other work held every core.

    Busy means a 1-minute load average above the cores before the bench began, or above twice
    the cores at its end (the bench itself keeps up to about one runnable thread per core).
    Beside that much work a contender's thread waits for a core at random, and a ratio of 1 is
    within reach of noise: a failed claim would say nothing about the install.
    """
    cores = result.machine.get("cores") or 1
    start = result.load_average.get("start", [0.0])[0]
    end = result.load_average.get("end", [0.0])[0]
    if start <= cores and end <= 2 * cores:
        return None
    return (
        f"too busy to check: load average {start:.1f} at the start, {end:.1f} at the end on "
        f"{cores} cores (checked at most {cores} before and {2 * cores} after); rerun on a "
        "quieter machine"
    )


class Check(NamedTuple):
    """A claim ``--check`` holds the run to, whether it held, and the figures behind it.

    ``held`` is None where the claim was not judged (the machine was too busy: ``evidence``
    says so, with the load).
    """

    claim: str
    held: bool | None
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
                ", ".join(f"ratio {k}: {figure(s, '.2f')}x" for k, s in speeds.items() if s),
            )
        )
    removed = result.stat("synthetic", "1", NOSTALL, "wait_removed")
    if removed:
        out.append(
            Check(
                "at ratio 1 nostall removes at least half of the serial loader's waiting",
                removed.median >= 0.5,
                figure(removed, ".0%"),
            )
        )
    handoff = _handoffs(result)
    if NOSTALL in handoff and len(handoff) > 1:
        ours = handoff.pop(NOSTALL)
        out.append(
            Check(
                "nostall's hand-off costs less than every peer prefetcher's",
                all(ours.median < s.median for s in handoff.values()),
                f"nostall {handoff_figure(ours)} us; "
                + ", ".join(f"{n} {handoff_figure(s)} us" for n, s in handoff.items()),
            )
        )
    busy = too_busy(result)
    if busy is None:
        return out
    return [Check(k.claim, None, f"{busy} ({k.evidence})") for k in out]
