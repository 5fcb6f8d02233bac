"""``nostall bench``: the same workload through the usual ways to load data and through nostall.

``run_bench(BenchConfig(...))`` measures; ``format_report``, ``write_json`` and ``write_plot``
show the result. The command line is a thin layer over these.
"""

from ._config import BenchConfig
from ._json import to_dict, write_json
from ._plot import write_plot
from ._records import BenchResult
from ._report import format_report
from ._runner import run_bench

__all__ = [
    "BenchConfig",
    "BenchResult",
    "format_report",
    "run_bench",
    "to_dict",
    "write_json",
    "write_plot",
]
