"""What the doctor says of its figures: the verdict, the speed-up, the summary, the JSON.

Each diagnosis here is made by hand, so the text is checked against known figures; measuring a
real loader is tested in test_doctor.py.
"""

from __future__ import annotations

import json

import pytest
from helpers import assert_honest

from nostall._tools.diagnosis import BUSY, ONE_RUN, Diagnosis, bound
from nostall._tools.thread_safety import ThreadSafety
from nostall._tools.tune import Setting, TuneResult
from nostall.cuda._timing import Measured


def _diagnosis(as_built: tuple[float, ...], best: tuple[float, ...]) -> Diagnosis:
    ours = (Setting(2, 4), Measured(best))
    theirs = (Setting(2, None), Measured(tuple(r / 2 for r in best)))
    search = TuneResult(Setting(2, 4), best[0], [(Setting(0, 2), as_built[0])], 14)
    loop = Measured(as_built)
    step = Measured((900.0, 900.0, 900.0))
    diagnosis = Diagnosis(loop, step, loop, search, ours, theirs, "cpu")
    diagnosis.code = "    loader = make_loader(num_workers=2)"
    return diagnosis


def test_a_best_within_the_spread_of_the_loop_as_built_is_no_speed_up() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(115.0, 130.0, 125.0))
    assert diagnosis.speedup is None
    assert "no setting is measurably faster" in diagnosis.summary()
    assert diagnosis.to_dict()["speedup"] is None


def test_a_best_that_is_the_loop_as_built_says_so() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(115.0, 130.0, 125.0))
    diagnosis.with_nostall = (Setting(0, None), diagnosis.with_nostall[1])
    diagnosis.factory_workers = 0  # make_loader(num_workers=0): what the loop as built uses
    assert "no setting is measurably faster: the best found is your loop as built " in (
        diagnosis.summary()
    )
    diagnosis.factory_workers = 2  # the factory's own is 2 workers: num_workers=0 is another
    assert "the best found, num_workers=0, no prefetcher, ran at" in diagnosis.summary()


def test_a_best_beyond_the_spread_is_a_speed_up_of_the_medians() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    assert diagnosis.speedup == pytest.approx(230.0 / 110.0)
    assert "2.09x yours" in diagnosis.summary()
    assert "change your code to:\n    loader = make_loader(num_workers=2)" in diagnosis.summary()
    assert_honest(diagnosis)


def test_a_loop_as_built_that_measured_zero_gives_no_infinite_speed_up() -> None:
    diagnosis = _diagnosis(as_built=(0.0, 0.0, 0.0), best=(0.0, 0.0, 0.0))
    assert diagnosis.speedup is None
    assert_honest(diagnosis)


def test_rates_say_their_spread() -> None:
    """The summary writes each rate in samples/s with the range of its runs."""
    diagnosis = _diagnosis(as_built=(1000.0, 1200.0, 1100.0), best=(1150.0, 1300.0, 1250.0))
    text = diagnosis.summary()
    assert "as built, the loop runs at 1,100 samples/s (1,000-1,200 over 3 runs)." in text


def test_the_diagnosis_says_whether_threads_or_processes_loaded_faster() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    assert diagnosis.threads_or_processes() is None  # no threads trial: nothing to compare
    diagnosis.search.curve += [(Setting(2, 2), 180.0), (Setting(0, 2, 4), 240.0)]
    line = diagnosis.threads_or_processes()
    assert line is not None
    assert "4 loading threads ran 240 samples/s, num_workers=2 180 samples/s" in line
    assert "threads loaded faster here" in line
    assert line in diagnosis.summary()
    diagnosis.search.curve.append((Setting(4, 2), 300.0))
    assert "worker processes loaded faster here" in str(diagnosis.threads_or_processes())
    close = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    close.search.curve += [(Setting(2, 2), 200.0), (Setting(0, 2, 4), 240.0)]  # 1.2x: noise
    assert "about the same here, no clear difference" in str(close.threads_or_processes())
    only_threads = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    only_threads.search.curve += [(Setting(0, 2, 2), 180.0), (Setting(2, 8), 400.0)]
    assert only_threads.threads_or_processes() is None  # num_workers=0, or another depth


def test_the_diagnosis_says_when_threads_ran_slower_than_one_thread() -> None:
    """Trivial samples (a TensorDataset): threads at 0.07x the serial loader, said plainly."""
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    diagnosis.search.curve += [(Setting(0, 2, 2), 7.0), (Setting(0, 2, 4), 5.0)]
    assert (
        "threads slower than one thread: the best, 2 loading threads, ran 7 samples/s, 0.07x "
        "the 100 samples/s of num_workers=0 loading in one thread"
    ) in diagnosis.summary()
    assert "leave threads= out" in diagnosis.to_dict()["summary"]
    close = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    close.search.curve += [(Setting(0, 2, 2), 90.0)]  # within one run's noise of 100
    assert "threads slower" not in close.summary()


def test_the_diagnosis_says_what_the_thread_safety_check_found() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    assert "thread safety" not in diagnosis.summary()  # threads not considered: no check
    diagnosis.search.thread_safety = ThreadSafety("differed", 4, 64, differed=(8, 15))
    line = diagnosis.summary().splitlines()[-1]
    assert line.startswith("thread safety: NOT thread-safe: with 4 threads at once, the batch")
    assert "of dataset[8] to dataset[15] came out other than one thread loaded it" in line
    safety = diagnosis.to_dict()["tune"]["thread_safety"]
    assert ("differed", [8, 15]) == (safety["verdict"], list(safety["differed"]))
    json.dumps(diagnosis.to_dict())  # --json writes it


def _figures(
    load: tuple[float, ...], step: tuple[float, ...], loop: tuple[float, ...]
) -> Diagnosis:
    """Loading alone, the step alone, and every loop (as built, and the best found) at ``loop``."""
    rate = Measured(loop)
    search = TuneResult(Setting(2, 4), loop[0], [(Setting(0, 2), loop[0])], 14)
    return Diagnosis(
        Measured(load),
        Measured(step),
        rate,
        search,
        (Setting(2, 4), rate),
        (Setting(2, None), rate),
        "cpu",
    )


def test_loading_slower_than_the_step_in_every_run_is_input_bound() -> None:
    assert "input-bound" == bound(Measured((100.0, 105.0, 110.0)), Measured((200.0, 210.0)), [])


def test_loading_faster_than_the_step_in_every_run_is_compute_bound() -> None:
    assert "compute-bound" == bound(Measured((300.0, 310.0)), Measured((100.0, 105.0)), [])


def test_close_figures_with_narrow_spreads_are_balanced() -> None:
    assert "balanced" == bound(Measured((100.0, 105.0, 110.0)), Measured((104.0, 112.0)), [])


def test_spreads_too_wide_to_call_are_too_busy_to_judge() -> None:
    """Loading 50-200, the step 90-150: the spread is wider than any difference it could show."""
    assert BUSY == bound(Measured((50.0, 100.0, 200.0)), Measured((90.0, 120.0, 150.0)), [])


def test_a_busy_machine_concludes_where_every_run_falls_apart() -> None:
    """Load 5.2 on 2 cores: runs 2x apart, every one, still say input-bound; close ones don't.

    The doctor once said "too busy" at load 14 with loading and the step 18x apart.
    """
    load, step = Measured((100.0, 105.0)), Measured((200.0, 210.0))
    assert "input-bound" == bound(load, step, [], load_average=5.2, cores=2)
    assert "input-bound" == bound(load, step, [], load_average=1.5, cores=2)
    assert "compute-bound" == bound(step, load, [], load_average=14.0, cores=2)
    close, overlapping = Measured((100.0, 110.0)), Measured((105.0, 112.0))
    assert "balanced" == bound(close, overlapping, [], load_average=1.5, cores=2)
    assert BUSY == bound(close, overlapping, [], load_average=5.2, cores=2)


def test_one_run_of_each_cannot_tell_the_bound() -> None:
    assert ONE_RUN == bound(Measured((100.0,)), Measured((200.0,)), [])


def test_without_a_step_the_bound_is_unknown() -> None:
    assert bound(Measured((100.0, 110.0)), None, []).startswith("unknown")


def test_a_loop_faster_than_the_step_alone_is_too_busy_to_judge() -> None:
    """The README's example: a loop at 962 samples/s with the step alone at 170 cannot be."""
    diagnosis = _figures(
        load=(1000.0, 1100.0, 1200.0), step=(160.0, 170.0, 180.0), loop=(950.0, 962.0, 980.0)
    )
    text = diagnosis.summary()
    assert text.startswith("too busy to judge: loading alone")
    assert (
        "faster than the step alone (170 samples/s (160-180 over 3 runs)), which cannot be" in text
    )
    assert "the step is the bottleneck" not in text


def test_the_step_is_the_bottleneck_only_where_no_loop_outran_it() -> None:
    diagnosis = _figures(
        load=(1000.0, 1100.0, 1200.0), step=(160.0, 170.0, 180.0), loop=(150.0, 160.0, 170.0)
    )
    assert "compute-bound" == diagnosis.bound
    assert "the step is the bottleneck" in diagnosis.summary()
    assert "cannot be" not in diagnosis.summary()


def test_a_best_slower_than_yours_says_yours_is_the_best_found() -> None:
    """Not "within the spread of yours" when the best found was 4x slower; no code to paste."""
    diagnosis = _diagnosis(as_built=(400.0, 410.0, 420.0), best=(100.0, 105.0, 110.0))
    text = diagnosis.summary()
    assert "your loop as built is the best found: no setting tried ran as fast" in text
    assert "within the spread" not in text
    assert diagnosis.to_dict()["code"] is None
    assert_honest(diagnosis)


def test_one_run_claims_no_speed_up() -> None:
    """--repeats 1: 1.06x in one run each is not "measurably faster"; it says it cannot tell."""
    diagnosis = _diagnosis(as_built=(100.0,), best=(106.0,))
    assert diagnosis.speedup is None
    text = diagnosis.summary()
    assert "measurably faster" not in text
    assert "cannot tell from one run whether num_workers=2, nostall.prefetch depth=4" in text
    assert diagnosis.to_dict()["code"] is None
    assert_honest(diagnosis)


def test_the_summary_says_the_load_it_was_measured_under() -> None:
    diagnosis = _diagnosis(as_built=(100.0, 120.0, 110.0), best=(230.0, 220.0, 240.0))
    diagnosis.load_average, diagnosis.cores, diagnosis.threads = 0.5, 2, 2
    line = "machine: load average up to 0.5 on 2 cores; the step ran with 2 threads."
    assert line in diagnosis.summary().splitlines()
    assert "input-bound" == diagnosis.bound
    diagnosis.load_average = 5.2  # loading 100-120 against the step's 900: apart at any load
    assert diagnosis.summary().startswith("input-bound: ")
    assert "so the verdict (input-bound) holds under this load" in diagnosis.summary()
    assert (5.2, 2) == (diagnosis.to_dict()["load_average"], diagnosis.to_dict()["cores"])
    diagnosis.step_rate = Measured((105.0, 112.0, 118.0))  # within loading's spread
    assert diagnosis.summary().startswith("too busy to judge: ")
    assert "run again when the machine is quieter" in diagnosis.summary()
