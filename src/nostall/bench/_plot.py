"""``--plot``: one chart per trial that ran, each contender in its own colour and marker.

A contender keeps its colour and marker in every panel (the registry's order decides them), so
a reader follows one line across panels; the title carries the machine and its load average.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..cuda._timing import Measured
from . import _contenders as c
from ._records import BenchResult

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "h", "<", ">")


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Write a PNG of :func:`draw`'s figure.

    Raises ``ImportError`` with the command that installs matplotlib when it is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'nostall[plot]'") from e
    fig = draw(result)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """Colour, marker and line width per contender: distinct for each, nostall's drawn bolder."""
    import matplotlib

    order = [k.name for k in c.ALL] + [n for n in names if n not in {k.name for k in c.ALL}]
    palette = [matplotlib.colormaps[m](i) for m in ("tab10", "Dark2") for i in range(8)]
    return {
        n: {
            "color": palette[i % len(palette)],
            "marker": _MARKERS[i % len(_MARKERS)],
            "linewidth": 2.4 if n.startswith("nostall") else 1.2,
        }
        for i, n in enumerate(order)
        if n in names
    }


def draw(result: BenchResult) -> Any:
    """The figure: a panel per trial that ran (GPU regime, synthetic, JPEG, hand-off)."""
    import matplotlib.pyplot as plt

    panels = [p for p in _PANELS if result.contenders(p[0])]
    # Two panels side by side; three or four in two rows, so that each stays readable on a page.
    columns = min(2, max(1, len(panels)))
    rows = max(1, -(-len(panels) // columns))
    fig, grid = plt.subplots(
        rows, columns, figsize=(7.0 * columns, 4.6 * rows + 1.2), squeeze=False
    )
    axes = list(grid.flat)
    names = list(dict.fromkeys(n for p in panels for n in result.contenders(p[0])))
    style = styles(names)
    for ax, (_, panel) in zip(axes, panels, strict=False):
        panel(ax, result, style)
        ax.grid(alpha=0.3)
    used = max(1, len(panels))
    for ax in axes[used:]:
        fig.delaxes(ax)  # three panels: the fourth place stays empty
    axes = axes[:used]
    handles: dict[str, Any] = {}  # the first panel's handle of each: a line with its marker
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=9)
    m = result.machine
    start = result.load_average.get("start", [0.0])[0]
    end = result.load_average.get("end", [0.0])[0]
    fig.suptitle(
        f"nostall bench: {m['device']}, {m['cores']} cores, torch {m['torch']}\nload average "
        f"{start:.2f} at the start, {end:.2f} at the end; median of {result.config.repeats} "
        "repeats, bars from the lowest to the highest"
    )
    fig.tight_layout(rect=(0, 1.1 / (4.6 * rows + 1.2), 1, 0.94))
    return fig


def _bars(ax: Any, stats: dict[str, Measured], style: dict[str, dict[str, Any]]) -> None:
    """A horizontal bar per contender at its median, min-max whiskers, its marker at the tip."""
    for i, (name, s) in enumerate(stats.items()):
        st = style[name]
        spread = [[s.median - s.low], [s.high - s.median]]
        ax.barh(i, s.median, xerr=spread, color=st["color"], alpha=0.8, capsize=3, label=name)
        ax.plot(s.median, i, st["marker"], color="black", markersize=5)
    ax.set_yticks(range(len(stats)), list(stats))
    ax.invert_yaxis()


def _synthetic(ax: Any, result: BenchResult, style: dict[str, dict[str, Any]]) -> None:
    settings = result.settings("synthetic")
    ratios = [float(s) for s in settings]
    for name in result.contenders("synthetic"):
        stats = [result.stat("synthetic", s, name, "speedup") for s in settings]
        if not all(stats):
            continue
        kept = [s for s in stats if s]
        spread = [[s.median - s.low for s in kept], [s.high - s.median for s in kept]]
        ours = name.startswith("nostall")
        ax.errorbar(
            ratios, [s.median for s in kept], spread, label=name, capsize=3, zorder=1 + ours,
            **style[name],
        )  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, settings)
    ax.set_xlabel("load / compute ratio (loading a batch over the step)")
    ax.set_ylabel("speed over the serial DataLoader (x)")
    ax.set_title("synthetic images: speed-up by ratio")


def _stats(result: BenchResult, trial: str, setting: str, metric: str) -> dict[str, Measured]:
    """Each contender's ``metric`` in ``trial`` at ``setting``, where it was measured."""
    return {n: s for n in result.contenders(trial) if (s := result.stat(trial, setting, n, metric))}


def _jpeg(ax: Any, result: BenchResult, style: dict[str, dict[str, Any]]) -> None:
    setting = result.settings("jpeg")[0]
    _bars(ax, _stats(result, "jpeg", setting, "samples_per_s"), style)
    ax.set_xlabel("samples/s")
    ax.set_title(f"JPEG files ({setting}): samples/s")


def _handoff(ax: Any, result: BenchResult, style: dict[str, dict[str, Any]]) -> None:
    # Runs below 0 are the plain loop's noise (a difference of timings): drawn at 0.
    stats = {
        n: Measured(tuple(max(0.0, v) for v in s.runs))
        for n, s in _stats(result, "handoff", "", "us_per_batch").items()
    }
    _bars(ax, stats, style)
    ax.set_xlabel("us per batch over a plain loop (0: within its noise)")
    ax.set_title("hand-off cost")


def _regime(ax: Any, result: BenchResult, style: dict[str, dict[str, Any]]) -> None:
    setting = result.settings("gpu regime")[0]
    _bars(ax, _stats(result, "gpu regime", setting, "efficiency"), style)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("epoch time over the GPU's own time (1: the GPU never waited for data)")
    ax.set_title(f"a GPU step of {setting}: how long each epoch took")


_PANELS = (
    ("gpu regime", _regime),
    ("synthetic", _synthetic),
    ("jpeg", _jpeg),
    ("handoff", _handoff),
)
