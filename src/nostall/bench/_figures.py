"""What the benchmark derives from its records: rows per ratio, hand-off, boundaries, workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._profile import stall_fraction
from . import _contenders as c
from ._metrics import handoff_us, median, overlap_efficiency, samples_per_s
from ._records import BenchResult, RatioResult


@dataclass(frozen=True)
class Row:
    """One contender at one ratio, as medians over the repeats."""

    contender: str
    ratio: float
    epoch_s: float
    samples_per_s: float
    efficiency: float
    stall: float
    speedup: float  # over the serial DataLoader in the same run
    unsafe: bool


def rows(result: BenchResult, ratio: RatioResult) -> list[Row]:
    """Derived figures for every contender at one ratio."""
    samples = result.config.batches * result.config.batch_size
    compute = median(ratio.compute_only_s)
    serial_run = ratio.runs.get(c.SERIAL.name)
    serial = median(serial_run.epoch_s) if serial_run else float("nan")
    out = []
    for run in ratio.runs.values():
        epoch = median(run.epoch_s)
        load = median(ratio.load_only_s[run.source])
        stalls = [stall_fraction(w, e) for w, e in zip(run.wait_s, run.epoch_s, strict=True)]
        out.append(
            Row(
                run.contender,
                ratio.ratio,
                epoch,
                samples_per_s(samples, epoch),
                overlap_efficiency(epoch, load, compute),
                median(stalls),
                serial / epoch,
                run.unsafe,
            )
        )
    return out


def handoff_table(result: BenchResult) -> dict[str, float]:
    """Hand-off overhead per batch (microseconds) of each prefetcher over the serial loop."""
    times = result.handoff_s
    if c.SERIAL.name not in times:
        return {}
    baseline = median(times[c.SERIAL.name])
    n = result.config.handoff_batches
    return {
        name: handoff_us(median(t), baseline, n)
        for name, t in times.items()
        if name != c.SERIAL.name
    }


@dataclass(frozen=True)
class Boundary:
    """How one way crosses epoch boundaries: intervals between batch arrivals, in seconds."""

    contender: str
    steady_s: float  # median interval within epochs
    boundary_s: float  # median interval from an epoch's last batch to the next one's first

    @property
    def ratio(self) -> float:
        """Boundary interval over the steady one: 1.0 is a seamless boundary."""
        return self.boundary_s / self.steady_s if self.steady_s > 0 else float("inf")


def boundaries(result: BenchResult) -> list[Boundary]:
    """Epoch-boundary figures for every contender of the ``--epochs`` test."""
    out = []
    for name, epochs in result.epoch_intervals.items():
        steady = [x for arrivals in epochs for x in arrivals[1:]]
        crossing = [arrivals[0] for arrivals in epochs[1:] if arrivals]
        if steady and crossing:
            out.append(Boundary(name, median(steady), median(crossing)))
    return out


def workers_needed(result: BenchResult) -> dict[str, int | None]:
    """Fewest loader workers with which each way of normalising keeps the step fed.

    "Fed" is 95% of the best rate any setting of either way reached (the compute-bound rate
    as measured in the loop); None when no worker count tried got there.
    """
    rates: dict[str, dict[Any, float]] = result.transforms.get("rates", {})
    if not rates:
        return {}
    top = max(r for by_count in rates.values() for r in by_count.values())
    out: dict[str, int | None] = {}
    for way, by_count in rates.items():
        fed = [int(c) for c, r in by_count.items() if r >= 0.95 * top]
        out[way] = min(fed) if fed else None
    return out


def loader_cores_needed(result: BenchResult) -> dict[str, float]:
    """Loader CPU cores each way of normalising needs to keep up with the step alone.

    The step's compute-bound rate (samples/s) times the loader's CPU seconds per sample: a
    machine with that many cores to spare for loading feeds the step; a worker is a core.
    """
    info = result.transforms
    if not info.get("loader_ms_per_sample"):
        return {}
    rate = info["compute_samples_per_s"]
    return {way: rate * ms / 1e3 for way, ms in info["loader_ms_per_sample"].items()}
