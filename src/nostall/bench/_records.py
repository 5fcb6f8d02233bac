"""What a bench run records (one tidy row per measured value) and the one aggregation over it.

Every figure shown is a :class:`Stat` (median, min-max) of the records sharing a key.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class Stat:
    """The median of some measurements, with their least and greatest values."""

    median: float
    low: float
    high: float
    n: int

    def __format__(self, spec: str) -> str:
        """``f"{stat:.2f}"`` gives "1.23 (1.20-1.31)": the median, then the spread."""
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"

    @property
    def exceeds_one(self) -> bool:
        """A ratio measurably above 1: even its least value is (``below_one``: the reverse)."""
        return self.low > 1.0

    @property
    def below_one(self) -> bool:
        """A ratio measurably below 1."""
        return self.high < 1.0


Key = tuple[str, str, str, str]  # trial, setting, contender, metric


def summarize(records: list[Record]) -> dict[Key, Stat]:
    """The one aggregation: a :class:`Stat` per trial, setting, contender and metric.

    Keys keep the order in which their first record arrived (the order of the run).
    """
    groups: dict[Key, list[float]] = defaultdict(list)
    for r in records:
        groups[(r.trial, r.setting, r.contender, r.metric)].append(r.value)
    return {k: Stat(statistics.median(v), min(v), max(v), len(v)) for k, v in groups.items()}


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

    def stat(self, trial: str, setting: str, contender: str, metric: str) -> Stat | None:
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
