"""The terminal report, from hand-made measurements."""

from __future__ import annotations

from test_bench_figures import result_with

from nostall.bench import format_report


def test_report_names_the_winner_and_marks_unsafe() -> None:
    """The verdict skips unsafe contenders; they are labelled in the table."""
    text = format_report(result_with(nostall_epoch=1.02, nostall_wait=0.01))
    assert "seed thread+Queue(2) (unsafe)" in text
    assert "winner: nostall, 1.47x the next (serial DataLoader)" in text
    assert "[met] hand-off" in text
