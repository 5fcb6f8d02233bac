"""--plot writes a chart."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import bench_result

from nostall.bench import write_plot


def test_plot_writes_a_png(tmp_path: Path) -> None:
    """A PNG with nostall and the peers, error bars from the spread."""
    pytest.importorskip("matplotlib")
    values = {}
    for ratio in ("0.5", "1"):
        for name, speedups in (("serial DataLoader", [1.0]), ("nostall", [1.4, 1.6])):
            values[("synthetic", ratio, name, "speedup")] = speedups
    path = tmp_path / "bench.png"
    write_plot(bench_result(values), path)
    assert path.read_bytes().startswith(b"\x89PNG")
