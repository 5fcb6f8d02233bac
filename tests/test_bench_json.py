"""``--json``: every raw and derived figure."""

from __future__ import annotations

import json
from pathlib import Path

from test_bench_figures import result_with

from nostall.bench import write_json


def test_json_has_raw_and_derived(tmp_path: Path) -> None:
    """--json writes every figure."""
    path = tmp_path / "bench.json"
    write_json(result_with(1.02, 0.01), path)
    data = json.loads(path.read_text())
    assert [1.02] == data["ratios"][1]["runs"]["nostall"]["epoch_s"]
    assert 6 == len(data["derived"]["rows"])
    assert data["derived"]["targets"]
