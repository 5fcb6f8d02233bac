"""``nostall bench``: the usual ways to load data and nostall, side by side, as tidy records.

``run_bench(BenchConfig(...))`` measures; ``format_report``, ``write_json`` and ``write_plot``
show; ``checks`` are the claims ``--check`` holds a run to.
"""

from ._config import BenchConfig
from ._plot import write_plot
from ._records import BenchResult, write_json
from ._report import checks, format_report
from ._trials import run_bench

__all__ = [
    "BenchConfig",
    "BenchResult",
    "checks",
    "format_report",
    "run_bench",
    "write_json",
    "write_plot",
]
