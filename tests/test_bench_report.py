"""The report says what was measured, in plain words, honest about the spread."""

from __future__ import annotations

from helpers import bench_result

from nostall.bench import checks, format_report
from nostall.bench._report import conclusion

SERIAL, OURS = "serial DataLoader", "nostall"


def sweep(
    light: list[float], heavy: list[float], removed: list[float]
) -> dict[tuple[str, str, str, str], list[float]]:
    """Ratios 0.25 and 1: nostall's speed-ups and the waiting it removed at ratio 1."""
    out = {}
    for ratio, speedups in (("0.25", light), ("1", heavy)):
        out[("synthetic", ratio, SERIAL, "speedup")] = [1.0] * len(speedups)
        out[("synthetic", ratio, SERIAL, "samples_per_s")] = [1000.0] * len(speedups)
        out[("synthetic", ratio, SERIAL, "stall")] = [0.5] * len(speedups)
        out[("synthetic", ratio, OURS, "speedup")] = speedups
        out[("synthetic", ratio, OURS, "stall")] = [0.05] * len(speedups)
        out[("synthetic", ratio, OURS, "wait_removed")] = removed
    out[("handoff", "", SERIAL, "us_per_batch")] = [0.0, 0.1]
    out[("handoff", "", OURS, "us_per_batch")] = [1.0, 1.2]
    out[("handoff", "", "torchdata.nodes", "us_per_batch")] = [30.0, 32.0]
    return out


def test_a_gain_a_cost_and_the_noise_are_told_apart() -> None:
    """A speed-up is a gain only when even its least value exceeds 1; a cost is named as one."""
    gain = conclusion(bench_result(sweep([1.2, 1.3, 1.25], [1.9, 2.0, 1.95], [0.9, 0.95, 0.9])))
    assert "At light load (ratio 0.25) nostall ran at 1.25x the serial loader's speed" in gain[0]
    assert "noise" not in gain[0]
    assert "removed 90% (90%-95%) of the serial loader's waiting" in gain[1]
    cost = conclusion(bench_result(sweep([0.8, 0.85, 0.9], [1.9], [0.9])))
    assert "a cost of 15%" in cost[0]
    noise = conclusion(bench_result(sweep([0.95, 1.1, 1.0], [1.9], [0.9])))
    assert "within the noise of 1x" in noise[0]


def test_hand_off_and_a_busy_machine_are_stated() -> None:
    """The hand-off against the cheapest peer; a load above half the cores is said."""
    quiet = conclusion(bench_result(sweep([1.2], [1.9], [0.9]), load=0.3))
    assert "cost nostall 1.1 us, the cheapest peer (torchdata.nodes) 31.0 us" in quiet[-1]
    busy = conclusion(bench_result(sweep([1.2], [1.9], [0.9]), load=3.5))
    assert "The machine was busy before the bench began (load average 3.5 on 2 cores)" in busy[-1]


def test_checks_hold_on_a_sound_run_and_fail_on_a_broken_one() -> None:
    """--check's claims: not slower than serial, half the waiting removed, cheapest hand-off."""
    sound = checks(bench_result(sweep([1.2, 1.3], [1.9, 2.0], [0.9, 0.95])))
    assert 3 == len(sound)
    assert all(c.held for c in sound)
    broken = sweep([0.7, 0.8], [1.9, 2.0], [0.2, 0.3])
    broken[("handoff", "", OURS, "us_per_batch")] = [40.0]
    failed = [c.claim for c in checks(bench_result(broken)) if not c.held]
    assert 3 == len(failed), failed
    assert checks(bench_result({})) == []  # nothing measured, nothing claimed


def test_report_shows_tables_spreads_and_the_conclusion_without_targets() -> None:
    """Every figure with its spread; no targets, no 'NOT met'."""
    text = format_report(bench_result(sweep([1.2, 1.3], [1.9, 2.0], [0.9, 0.95])))
    assert "load average 0.20 at the start, 0.20 at the end" in " ".join(text.split())
    assert "1.25 (1.20-1.30)" in text
    assert "serial 1,000/s" in text
    assert "conclusion:" in text
    assert "target" not in text.lower()
    assert "NOT met" not in text
