"""The doctor's HTML page: its chart's labels, axis and rows, on a diagnosis made by hand."""

from __future__ import annotations

import re

from nostall._tools.diagnosis import Diagnosis
from nostall._tools.doctor_report import CHAR_PX, chart_rows, html_page
from nostall._tools.tune import Setting, TuneResult
from nostall.cuda._timing import Measured


def _diagnosis() -> Diagnosis:
    """Threads 2 and 4 tried in the search; threads=4 measured again as the best found."""
    curve = [(Setting(0, 2), 100.0), (Setting(0, 2, 2), 180.0), (Setting(0, 2, 4), 250.0)]
    search = TuneResult(Setting(0, 2, 4), 240.0, curve, 42)
    best = (Setting(0, 2, 4), Measured((230.0, 240.0, 250.0)))
    plain = (Setting(0, None), Measured((95.0, 100.0, 105.0)))
    loop = Measured((95.0, 100.0, 105.0))
    return Diagnosis(loop, None, loop, search, best, plain, "cpu")


def _labels(page: str) -> list[str]:
    return re.findall(r'<text x="0" y="\d+" font-size="12">([^<]*)</text>', page)


def test_the_chart_labels_tell_threads_2_from_threads_4() -> None:
    labels = _labels(html_page(_diagnosis()))
    assert "search trial, one run: workers=0, prefetch depth=2 threads=2" in labels
    assert any(
        label.startswith("search trial, one run: workers=0, prefetch depth=2 threads=4")
        for label in labels
    )


def test_the_chart_labels_are_not_cut_by_the_bars() -> None:
    """The bars start right of the longest label, at its widest rendering."""
    page = html_page(_diagnosis())
    left = min(float(x) for x in re.findall(r'<rect x="([\d.]+)"', page))
    assert all(CHAR_PX * len(label) < left for label in _labels(page))


def test_the_chart_has_its_unit_on_the_axis() -> None:
    page = html_page(_diagnosis())
    assert "samples/s (bar: median; line: the range of the runs)</text>" in page
    assert ">250</text>" in page  # the axis ends at the highest run


def test_a_search_trial_measured_again_says_so() -> None:
    """One run of threads=4 in the search, beside its three runs after it: labelled as such."""
    rows = dict(chart_rows(_diagnosis()))
    assert (
        Measured((250.0,))
        == rows[
            "search trial, one run: workers=0, prefetch depth=2 threads=4, measured again above"
        ]
    )
    assert (
        Measured((230.0, 240.0, 250.0))
        == rows["best found: workers=0, prefetch depth=2 threads=4, 3 runs"]
    )
    assert "search trial, one run: workers=0, prefetch depth=2 threads=2" in rows
