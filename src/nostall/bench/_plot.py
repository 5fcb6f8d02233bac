"""``--plot``: a PNG of throughput, stalls and overlap efficiency per contender."""

from __future__ import annotations

from pathlib import Path

from ._figures import rows
from ._records import BenchResult


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Write a PNG: samples/s and stall per contender at ratio 1 (or the first), E by ratio.

    Raises:
        ImportError: matplotlib is missing, with the command that installs it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib: pip install 'nostall[plot]' (or pip install matplotlib)"
        ) from e
    focus = next((r for r in result.ratios if r.ratio == 1), result.ratios[0])
    table = rows(result, focus)
    names = [r.contender + (" (unsafe)" if r.unsafe else "") for r in table]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5))
    axes[0].barh(names, [r.samples_per_s for r in table], color="tab:blue")
    axes[0].set_xlabel("samples/s")
    axes[0].set_title(f"throughput at load/compute ratio {focus.ratio:g}")
    axes[0].invert_yaxis()
    # Stalls matter most where loading is shorter than the step: there any wait is avoidable.
    stall_at = next((r for r in result.ratios if r.ratio == 0.5), focus)
    stalls = {r.contender: r.stall for r in rows(result, stall_at)}
    axes[1].barh(names, [100 * stalls.get(r.contender, 0.0) for r in table], color="tab:red")
    axes[1].set_xlabel("% of the epoch waiting for data")
    axes[1].set_title(f"stall fraction at ratio {stall_at.ratio:g}")
    axes[1].invert_yaxis()
    axes[1].set_yticklabels([])
    ratios = [r.ratio for r in result.ratios]
    for name in focus.runs:
        series = [
            next(row.efficiency for row in rows(result, r) if row.contender == name)
            for r in result.ratios
        ]
        axes[2].plot(ratios, series, marker="o", label=name)
    axes[2].axhline(1.0, color="black", linewidth=0.8)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xlabel("load / compute ratio")
    axes[2].set_ylabel("E = epoch / max(load, compute)")
    axes[2].set_title("overlap efficiency (1 is perfect)")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"nostall bench: {result.machine['device']}, torch {result.machine['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
