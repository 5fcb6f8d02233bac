"""The report says what was measured, in plain words, honest about the spread."""

from __future__ import annotations

from helpers import bench_result

from nostall.bench import checks, format_report
from nostall.bench._report import conclusion, too_busy

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


def test_a_cost_below_half_a_percent_is_not_called_zero() -> None:
    """Below 1 in every run but 0.998 at the median: "a cost below 1%", never "a cost of 0%"."""
    small = conclusion(bench_result(sweep([0.997, 0.998, 0.999], [1.9], [0.9])))
    assert "a cost below 1%" in small[0]
    assert "0%" not in small[0].split("speed")[1]


def test_one_loader_worker_is_one_worker() -> None:
    """The header counts in the singular where there is one."""
    result = bench_result(sweep([1.2], [1.9], [0.9]))
    result.machine["workers"] = 1
    assert "1 loader worker," in format_report(result)
    result.machine["workers"] = 2
    assert "2 loader workers," in format_report(result)


def test_hand_off_and_a_busy_machine_are_stated() -> None:
    """The hand-off against the cheapest peer; a load above half the cores is said."""
    quiet = conclusion(bench_result(sweep([1.2], [1.9], [0.9]), load=0.3))
    assert (
        "nostall 1.1 (1.0-1.2) us, the cheapest peer (torchdata.nodes) 31.0 (30.0-32.0) us"
        in (quiet[-1])
    )
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


def test_a_one_run_figure_is_shown_alone_never_as_a_range_of_zero_width() -> None:
    """One repeat: "1.90 (n=1)" in the table and the conclusion, no "1.90 (1.90-1.90)"."""
    result = bench_result(sweep([1.2], [1.9], [0.9]))
    text = " ".join(format_report(result).split())
    assert "1.90 (n=1)" in text
    assert "1.90 (1.90-1.90)" not in text
    assert "removed 90% (n=1) of the serial loader's waiting" in text
    assert "1.00 (1.00-1.00)" not in text  # the serial loader is the baseline, not a figure


def test_a_hand_off_within_the_noise_is_a_bound_never_negative() -> None:
    """Runs below the plain loop's median (noise) read "within noise (at most ...)", no minus."""
    values = sweep([1.2, 1.3], [1.9, 2.0], [0.9, 0.95])
    values[("handoff", "", OURS, "us_per_batch")] = [-6.8, -1.0, 0.4]
    text = " ".join(format_report(bench_result(values)).split())
    assert "within noise (at most 0.4)" in text
    assert "-6.8" not in text
    assert "-1.0" not in text
    assert "-0.1" not in text  # the serial loop's own runs around 0 are the baseline
    (sentence,) = [s for s in conclusion(bench_result(values)) if s.startswith("Handing")]
    assert "cost nostall within noise (at most 0.4) us" in sentence


def jpeg(rates: dict[str, list[float]]) -> dict[tuple[str, str, str, str], list[float]]:
    """The JPEG trial's samples/s per contender."""
    return {("jpeg", "224px", name, "samples_per_s"): runs for name, runs in rates.items()}


def test_no_fastest_is_named_when_the_spreads_overlap() -> None:
    """Overlapping spreads: "tied within the spread", the tied ones named, no "fastest was"."""
    rates = {SERIAL: [300.0, 310.0], "torchdata.nodes": [560.0, 600.0], OURS: [540.0, 580.0]}
    tied = conclusion(bench_result(jpeg(rates)))
    assert "torchdata.nodes and nostall tied within the spread" in tied[0]
    assert "fastest was" not in tied[0]


def test_the_fastest_is_named_when_its_spread_clears_the_others() -> None:
    """A lead whose least run beats every other's best is named the fastest."""
    clear = conclusion(bench_result(jpeg({SERIAL: [300.0, 310.0], OURS: [540.0, 580.0]})))
    assert "the fastest was nostall, 560 (540-580) samples/s." in clear[0]


def test_checks_are_not_judged_on_a_busy_machine() -> None:
    """At load 6 on 2 cores the claims are "not judged" (None), the load named, none failed."""
    broken = sweep([0.985, 0.99, 0.995], [1.9, 2.0], [0.9, 0.95])
    busy = checks(bench_result(broken, load=6.0))
    assert 3 == len(busy)
    assert all(c.held is None for c in busy)
    assert "too busy to check: load average 6.0 at the start" in busy[0].evidence
    assert not checks(bench_result(broken, load=0.5))[0].held  # judged when quiet: it fails


def test_the_load_at_the_end_alone_can_make_a_run_too_busy() -> None:
    """Work that began during the bench (end load above twice the cores) counts too."""
    result = bench_result({}, load=0.5)
    assert too_busy(result) is None
    result.load_average["end"] = [4.5, 3.0, 2.0]
    assert "4.5 at the end on 2 cores" in str(too_busy(result))


def test_the_convoy_is_tabled_and_judged_against_the_loop_and_the_seed() -> None:
    """Each case's figures in the hand-off section; the conclusion counts where nostall led."""
    values = sweep([1.2], [1.9], [0.9])
    for setting, loop, seed, ours in (("20,20,1", 42, 29, 28), ("20,20,8", 53, 70, 60)):
        values[("convoy", setting, "serial loop", "us_per_batch")] = [loop, loop + 1]
        values[("convoy", setting, "seed thread+Queue(2)", "us_per_batch")] = [seed, seed + 1]
        values[("convoy", setting, OURS, "us_per_batch")] = [ours, ours + 1]
    result = bench_result(values)
    text = format_report(result)
    assert "hand-off with GIL-free calls on both threads" in text
    assert "60.5 (60.0-61.0)" in text
    verdict = conclusion(result)[-1]
    assert "in 1 of 2 cases" in verdict
    assert "0.97x, 1.13x" in verdict  # 28.5 / 29.5 and 60.5 / 53.5


def test_no_convoy_no_verdict() -> None:
    """A run without the convoy says nothing about it."""
    text = " ".join(conclusion(bench_result(sweep([1.2], [1.9], [0.9]))))
    assert "GIL-free" not in text
