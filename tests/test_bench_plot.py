"""--plot writes a chart: each contender its own colour and marker, the load, every trial."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import bench_result

from nostall.bench import write_plot
from nostall.bench._plot import draw

pytest.importorskip("matplotlib")

PEERS = ("serial DataLoader", "prefetch_generator", "torchdata.nodes", "seed thread+Queue(2)")
NAMES = (*PEERS, "nostall", "nostall + workers")


def every_trial() -> dict[tuple[str, str, str, str], list[float]]:
    """Synthetic speed-ups at two ratios, JPEG samples/s and hand-off costs for every name."""
    values = {}
    for i, name in enumerate(NAMES):
        for ratio in ("0.5", "1"):
            values[("synthetic", ratio, name, "speedup")] = [1.0 + i / 10, 1.1 + i / 10]
        values[("jpeg", "224px", name, "samples_per_s")] = [300.0 + i, 320.0 + i]
        values[("handoff", "", name, "us_per_batch")] = [-6.8, 1.0 + i]
    return values


def test_plot_writes_a_png(tmp_path: Path) -> None:
    """A PNG with nostall and the peers, error bars from the spread."""
    path = tmp_path / "bench.png"
    write_plot(bench_result(every_trial()), path)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_each_contender_has_its_own_colour_and_marker() -> None:
    """No two lines of the speed-up panel share a colour or a marker (peers included)."""
    fig = draw(bench_result(every_trial()))
    lines = [b.lines[0] for b in fig.axes[0].containers if b.get_label() in NAMES]
    assert len(NAMES) == len(lines)
    assert len(NAMES) == len({tuple(ln.get_color()) for ln in lines})
    assert len(NAMES) == len({ln.get_marker() for ln in lines})


def test_the_title_shows_the_load_average() -> None:
    """The load at the start and the end is in the chart's title."""
    fig = draw(bench_result(every_trial(), load=3.25))
    assert "load average 3.25 at the start, 3.25 at the end" in fig._suptitle.get_text()


def test_jpeg_and_hand_off_results_have_their_panels() -> None:
    """One panel per trial that ran: synthetic, JPEG, hand-off (noise below 0 drawn at 0)."""
    fig = draw(bench_result(every_trial()))
    titles = [ax.get_title() for ax in fig.axes]
    assert ["synthetic images", "JPEG files (224px)", "hand-off cost"] == [
        t.split(":")[0] for t in titles
    ]
    assert min(bar.get_width() for bar in fig.axes[2].patches) >= 0


def test_the_gpu_regime_panel_comes_first_with_a_bar_per_contender() -> None:
    """The headline (each epoch's time over the GPU's own), a bar per contender, leads."""
    values = every_trial()
    for i, name in enumerate(NAMES):
        values[("gpu regime", "8.0 ms", name, "efficiency")] = [1.0 + i / 5, 1.1 + i / 5]
    fig = draw(bench_result(values))
    assert "GPU step" in fig.axes[0].get_title()
    assert "E =" not in fig.axes[0].get_xlabel()
    assert len(NAMES) == len(fig.axes[0].patches)


def test_four_panels_take_two_rows() -> None:
    """Four panels in two rows of two, each wide enough to read at a page's width."""
    values = every_trial()
    for i, name in enumerate(NAMES):
        values[("gpu regime", "8.0 ms", name, "efficiency")] = [1.0 + i / 5, 1.1 + i / 5]
    fig = draw(bench_result(values))
    assert 4 == len(fig.axes)
    rows = {round(ax.get_position().y0, 2) for ax in fig.axes}
    assert 2 == len(rows)
