"""``--plot``: the PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_bench_figures import result_with

from nostall.bench import write_plot


def test_plot_writes_a_png(tmp_path: Path) -> None:
    """--plot writes a PNG (matplotlib is in the dev set-up)."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    write_plot(result_with(1.02, 0.01), path)
    assert path.read_bytes().startswith(b"\x89PNG")
