"""A tiny benchmark run on the CPU, in seconds."""

from __future__ import annotations

import pytest

from nostall.bench import BenchConfig, format_report, run_bench, to_dict
from nostall.bench._figures import rows

#: The smallest run that still exercises every contender; the trials' tests reuse it.
TINY = dict(
    batches=6,
    batch_size=8,
    image_size=16,
    width=4,
    repeats=1,
    handoff_batches=50,
    device="cpu",
    progress=False,
    epochs=0,
)


def test_tiny_run_measures_every_contender() -> None:
    """Every contender that can run here has a row at every ratio, with sane figures."""
    result = run_bench(BenchConfig(ratios=(0.5, 2.0), **TINY))  # type: ignore[arg-type]
    assert [0.5, 2.0] == [r.ratio for r in result.ratios]
    names = {
        "serial DataLoader",
        "best-practice DataLoader",
        "seed thread+Queue(2)",
        "prefetch_generator",
        "torchdata.nodes",
        "nostall",
        "nostall + workers",
    }
    for ratio in result.ratios:
        table = rows(result, ratio)
        assert names == {row.contender for row in table}
        for row in table:
            assert row.epoch_s > 0
            assert row.efficiency > 0
            assert 0 <= row.stall <= 1
    assert {
        "seed thread+Queue(2)",
        "prefetch_generator",
        "torchdata.nodes",
        "nostall",
        "serial DataLoader",
    } == set(result.handoff_s)
    text = format_report(result)
    assert "winner:" in text
    assert "hand-off overhead" in text
    assert "targets" in text
    assert "nostall" in to_dict(result)["derived"]["handoff_us"]


@pytest.mark.perf
def test_equal_load_and_compute_take_close_to_half_the_serial_time() -> None:
    """GIL-releasing loading as long as the step: nostall needs far less than the serial sum."""
    config = BenchConfig(
        ratios=(1.0,),
        io_share=1.0,
        contenders=("serial DataLoader", "nostall"),
        **{**TINY, "batches": 16, "width": 16, "image_size": 32, "batch_size": 16, "repeats": 3},
    )  # type: ignore[arg-type]
    (ratio,) = run_bench(config).ratios  # the fastest of 3 alternating runs: noise only adds
    serial = min(ratio.runs["serial DataLoader"].epoch_s)
    ours = min(ratio.runs["nostall"].epoch_s)
    assert ours < 0.75 * serial, f"nostall {ours:.3f} s vs serial {serial:.3f} s"


def test_depth_sweep_names_each_depth() -> None:
    """--depths makes one nostall contender per depth."""
    result = run_bench(BenchConfig(ratios=(1.0,), depths=(1, 4), contenders=("nostall",), **TINY))  # type: ignore[arg-type]
    assert {"nostall (depth 1)", "nostall (depth 4)"} == set(result.ratios[0].runs)
