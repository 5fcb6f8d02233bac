"""``--plot``: speed over the serial loader and stall by ratio, nostall drawn over the others."""

from __future__ import annotations

from pathlib import Path

from ._records import BenchResult


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Write a PNG: each contender's speed over the serial loader by ratio, min-max error bars.

    nostall's contenders are drawn in strong colours over the others in grey. Raises
    ``ImportError`` with the command that installs matplotlib when it is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("--plot needs matplotlib: pip install 'nostall[plot]'") from e
    settings = result.settings("synthetic")
    ratios = [float(s) for s in settings]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    strong = iter(("tab:red", "tab:blue", "tab:green"))
    for name in result.contenders("synthetic"):
        stats = [result.stat("synthetic", s, name, "speedup") for s in settings]
        if not all(stats):
            continue
        ours = name.startswith("nostall")
        color, width = (next(strong, "black"), 2.6) if ours else ("0.65", 1.0)
        spread = [[s.median - s.low for s in stats if s], [s.high - s.median for s in stats if s]]
        medians = [s.median for s in stats if s]
        ax.errorbar(
            ratios, medians, spread, label=name, color=color, linewidth=width, zorder=1 + ours,
            marker="o", capsize=3,
        )  # fmt: skip
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ratios, settings)
    ax.set_xlabel("load / compute ratio (loading a batch over the step)")
    ax.set_ylabel("speed over the serial DataLoader (x)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    m = result.machine
    ax.set_title(
        f"nostall bench: {m['device']}, {m['cores']} cores, torch {m['torch']}; median of "
        f"{result.config.repeats} repeats, bars min-max"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
