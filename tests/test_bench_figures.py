"""Derived figures from hand-made measurements."""

from __future__ import annotations

import math

from nostall.bench import BenchConfig, BenchResult
from nostall.bench._figures import boundaries, handoff_table, rows, workers_needed
from nostall.bench._records import RatioResult, Run

MACHINE = {"device": "cpu", "torch": "x", "cores": 2, "workers": 1, "compute_threads": 1}


def result_with(nostall_epoch: float, nostall_wait: float) -> BenchResult:
    """Ratios 0.5 and 1: compute-only 1.0 s, loading 0.5 s or 1.0 s, 10 batches of 10.

    The hand-made run that the figures, targets, report, JSON and plot tests read.
    """
    config = BenchConfig(
        batches=10,
        batch_size=10,
        ratios=(0.5, 1.0),
        repeats=1,
        handoff_batches=1000,
        progress=False,
    )
    result = BenchResult(config, MACHINE, 100.0)
    for ratio in (0.5, 1.0):
        r = RatioResult(ratio, 1.0, {"serial": [ratio], "workers": [ratio]}, [1.0])
        r.runs["serial DataLoader"] = Run(
            "serial DataLoader", "serial", False, [1.0 + ratio], [ratio]
        )
        r.runs["seed thread+Queue(2)"] = Run("seed thread+Queue(2)", "serial", True, [0.9], [0.0])
        r.runs["nostall"] = Run("nostall", "serial", False, [nostall_epoch], [nostall_wait])
        result.ratios.append(r)
    # serial baseline 0.010 s; nostall 0.020 s (10 us/batch); seed 0.040 s (30 us/batch)
    result.handoff_s = {
        "serial DataLoader": [0.010],
        "nostall": [0.020],
        "seed thread+Queue(2)": [0.040],
    }
    return result


def test_rows_derive_every_figure() -> None:
    """E, stall, samples/s and speed-up over serial, from the medians."""
    result = result_with(nostall_epoch=1.02, nostall_wait=0.01)
    table = {r.contender: r for r in rows(result, result.ratios[1])}
    serial, ours = table["serial DataLoader"], table["nostall"]
    assert math.isclose(2.0, serial.efficiency)
    assert math.isclose(0.5, serial.stall)
    assert math.isclose(50.0, serial.samples_per_s)
    assert math.isclose(1.02, ours.efficiency)
    assert math.isclose(2.0 / 1.02, ours.speedup)
    assert table["seed thread+Queue(2)"].unsafe


def test_handoff_is_over_the_serial_loop() -> None:
    """Microseconds per batch above the plain loop."""
    table = handoff_table(result_with(1.0, 0.0))
    assert math.isclose(10.0, table["nostall"])
    assert math.isclose(30.0, table["seed thread+Queue(2)"])


def test_epoch_boundary_ratio() -> None:
    """The boundary interval over the steady one."""
    result = result_with(1.02, 0.01)
    result.epoch_intervals = {
        "DataLoader, workers restarted": [[0.9, 0.01, 0.01], [0.05, 0.01, 0.01]],
        "nostall across_epochs": [[0.9, 0.01, 0.01], [0.012, 0.01, 0.01]],
    }
    table = {b.contender: b for b in boundaries(result)}
    assert math.isclose(5.0, table["DataLoader, workers restarted"].ratio)
    assert math.isclose(1.2, table["nostall across_epochs"].ratio)


def test_workers_needed() -> None:
    """The fewest workers within 95% of the best rate, per way of normalising."""
    result = result_with(1.02, 0.01)
    result.transforms = {
        "image_size": 8,
        "compute_samples_per_s": 1000.0,
        "bytes_per_sample": {"cpu": 768, "device": 192},
        "rates": {"cpu": {0: 300.0, 1: 600.0, 2: 960.0}, "device": {0: 500.0, 1: 990.0}},
    }
    assert {"cpu": 2, "device": 1} == workers_needed(result)
