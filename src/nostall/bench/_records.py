"""What a benchmark run records: raw measurements, per ratio, per contender, per repeat.

Nothing here is derived; ``_figures`` and ``_targets`` read these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ._config import BenchConfig


@dataclass
class Run:
    """One contender at one load/compute ratio: a value per repeat."""

    contender: str
    source: str
    unsafe: bool
    epoch_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)


@dataclass
class RatioResult:
    """Everything measured at one load/compute ratio."""

    ratio: float
    load_ms_per_sample: float
    load_only_s: dict[str, list[float]] = field(default_factory=dict)
    compute_only_s: list[float] = field(default_factory=list)
    runs: dict[str, Run] = field(default_factory=dict)


@dataclass
class BenchResult:
    """Raw measurements of one ``nostall bench`` run (see ``_figures`` for what is derived)."""

    config: BenchConfig
    machine: dict[str, Any]
    compute_ms_per_batch: float
    ratios: list[RatioResult] = field(default_factory=list)
    handoff_s: dict[str, list[float]] = field(default_factory=dict)
    h2d: list[dict[str, float]] = field(default_factory=list)
    #: ``--gpu-transforms``: per way of normalising, samples/s by number of loader workers.
    transforms: dict[str, Any] = field(default_factory=dict)
    #: Per contender: seconds between consecutive batch arrivals, one list per epoch.
    epoch_intervals: dict[str, list[list[float]]] = field(default_factory=dict)
