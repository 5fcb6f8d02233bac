"""The tidy records and their one aggregation."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import bench_result

from nostall.bench import write_json
from nostall.bench._records import Record, summarize
from nostall.cuda._timing import Measured


def test_summarize_gives_median_and_spread_in_arrival_order() -> None:
    """One figure per trial, setting, contender and metric, in the order of the run."""
    records = [
        Record("t", "b", "x", "m", 3.0),
        Record("t", "a", "x", "m", 1.0),
        Record("t", "b", "x", "m", 1.0),
        Record("t", "b", "x", "m", 2.0),
    ]
    stats = summarize(records)
    assert [("t", "b", "x", "m"), ("t", "a", "x", "m")] == list(stats)
    assert Measured((3.0, 1.0, 2.0)) == stats[("t", "b", "x", "m")]
    assert Measured((1.0,)) == stats[("t", "a", "x", "m")]


def test_result_lists_settings_and_contenders_in_order() -> None:
    """What a trial ran, in the order it ran it; a missing figure is None."""
    result = bench_result(
        {
            ("synthetic", "0.5", "serial DataLoader", "speedup"): [1.0],
            ("synthetic", "0.5", "nostall", "speedup"): [1.5, 1.7],
            ("synthetic", "1", "nostall", "speedup"): [1.9],
        }
    )
    assert ["0.5", "1"] == result.settings("synthetic")
    assert ["serial DataLoader", "nostall"] == result.contenders("synthetic")
    assert 1.6 == result.stat("synthetic", "0.5", "nostall", "speedup").median
    assert result.stat("synthetic", "1", "serial DataLoader", "speedup") is None


def test_json_holds_every_record_and_the_settings(tmp_path: Path) -> None:
    """--json: the config, the machine, the load and every record; nothing unserialisable."""
    result = bench_result({("handoff", "", "nostall", "us_per_batch"): [1.0, 2.0]})
    write_json(result, tmp_path / "bench.json")
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {"config", "machine", "load_average", "seconds", "records"} == set(data)
    assert [1.0, 2.0] == [r["value"] for r in data["records"]]
    assert 3 == data["config"]["repeats"]
