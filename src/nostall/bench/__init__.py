"""``nostall bench``: the usual ways to load data and nostall, side by side, as tidy records.

``run_bench(BenchConfig(...))`` measures; ``format_report``, ``write_json`` and ``write_plot``
show; ``checks`` are the claims ``--check`` holds a run to.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._config import BenchConfig
    from ._plot import write_plot
    from ._records import BenchResult, write_json
    from ._report import checks, format_report
    from ._trials import run_bench

#: Where each public name lives: imported on first use, so that ``nostall --help`` (which
#: builds its flags from ``_config``) loads neither torch nor the trials.
_HOME = {
    "BenchConfig": "._config",
    "BenchResult": "._records",
    "checks": "._report",
    "format_report": "._report",
    "run_bench": "._trials",
    "write_json": "._records",
    "write_plot": "._plot",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "BenchConfig",
    "BenchResult",
    "checks",
    "format_report",
    "run_bench",
    "write_json",
    "write_plot",
]
