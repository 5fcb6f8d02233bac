"""The ``--epochs`` trial: arrival intervals across epoch boundaries, on the CPU."""

from __future__ import annotations

from test_bench_runner import TINY

from nostall.bench import BenchConfig, format_report, run_bench
from nostall.bench._epoch_boundaries import EPOCH_CONTENDERS
from nostall.bench._figures import boundaries


def test_epoch_boundary_test_measures_every_way() -> None:
    """--epochs records arrival intervals per epoch for each way of crossing a boundary."""
    config = BenchConfig(ratios=(1.0,), contenders=("nostall",), **{**TINY, "epochs": 2})  # type: ignore[arg-type]
    result = run_bench(config)
    assert set(EPOCH_CONTENDERS) == set(result.epoch_intervals)
    for epochs in result.epoch_intervals.values():
        assert [6, 6] == [len(arrivals) for arrivals in epochs]
    assert len(boundaries(result)) == len(EPOCH_CONTENDERS)
    assert "epoch boundaries over 2 epochs" in format_report(result)
