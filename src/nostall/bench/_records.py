"""What a bench run records (one tidy row per measured value) and the one aggregation over it.

Every figure shown is a :class:`~nostall.cuda._timing.Measured` (median, min-max) of the records
sharing a key.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cuda._timing import Measured
from ._config import BenchConfig


@dataclass(frozen=True)
class Record:
    """One measured value of a ``trial`` at a ``setting`` ("" for none), for a ``contender``.

    ``metric`` names it (e.g. "speedup": over the serial loader of the same repeat); ``repeat``
    is the repeat, or the timed block of a micro-benchmark, it came from.
    """

    trial: str
    setting: str
    contender: str
    metric: str
    value: float
    repeat: int = 0


Key = tuple[str, str, str, str]  # trial, setting, contender, metric


def summarize(records: list[Record]) -> dict[Key, Measured]:
    """The one aggregation: a figure per trial, setting, contender and metric (its runs).

    Keys keep the order in which their first record arrived (the order of the run).
    """
    groups: dict[Key, list[float]] = defaultdict(list)
    for r in records:
        groups[(r.trial, r.setting, r.contender, r.metric)].append(r.value)
    return {k: Measured(tuple(v)) for k, v in groups.items()}


@dataclass
class BenchResult:
    """A bench run: its settings, the machine, the load around it and every record."""

    config: BenchConfig
    machine: dict[str, Any]
    load_average: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0
    records: list[Record] = field(default_factory=list)
    #: torch.utils.benchmark measurements of the micro-benchmarks, for ``Compare``.
    measurements: list[Any] = field(default_factory=list)

    def stat(self, trial: str, setting: str, contender: str, metric: str) -> Measured | None:
        """The aggregated figure, or None when nothing was measured for it."""
        return summarize(self.records).get((trial, setting, contender, metric))

    def settings(self, trial: str) -> list[str]:
        """The settings one trial ran, in order (``contenders``: whom it measured)."""
        return list(dict.fromkeys(r.setting for r in self.records if r.trial == trial))

    def contenders(self, trial: str) -> list[str]:
        return list(dict.fromkeys(r.contender for r in self.records if r.trial == trial))


def write_json(result: BenchResult, path: str | Path) -> None:
    """Write the settings, the machine, the load and every record as JSON (``--json``)."""
    raw = dataclasses.asdict(dataclasses.replace(result, measurements=[]))
    del raw["measurements"]  # torch.utils.benchmark objects; the records hold their times
    raw["config"]["device"] = None if result.config.device is None else str(result.config.device)
    Path(path).write_text(json.dumps(raw, indent=2) + "\n")
