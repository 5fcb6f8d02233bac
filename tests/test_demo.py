"""The side-by-side demo that make bench runs until the full benchmark lands."""

from __future__ import annotations

from nostall._demo import DemoResult, format_demo, run_demo


def test_equal_load_and_step_take_close_to_half_the_serial_time() -> None:
    """Loading and a GIL-releasing step of equal length: prefetched is far below serial."""
    result = run_demo(batches=16, load_ms=30, step_ms=30, repeats=1, device="cpu")
    ratio = result.median("nostall.prefetch") / result.median("serial DataLoader")
    assert ratio < 0.75, f"prefetched took {ratio:.0%} of the serial time"


def test_format_names_the_ways_and_the_speed_up() -> None:
    """The table shows each way with its speed-up over serial."""
    result = DemoResult(
        10,
        0.02,
        0.02,
        "cpu",
        {
            "serial DataLoader": [0.4, 0.42],
            "nostall.prefetch": [0.2, 0.21],
            "load only": [0.2],
            "step only": [0.19],
        },
    )
    text = format_demo(result)
    assert "2.00x" in text.split("nostall.prefetch")[1]
    assert "1.00x" in text.split("serial DataLoader")[1]
    assert "took 50% of the serial time" in text
    assert "ideal overlap max(load, step) = 0.200 s" in text
    assert "(1.02x the ideal overlap)" in text
