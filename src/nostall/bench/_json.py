"""``--json``: every raw and derived figure of a run, as JSON."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ._figures import boundaries, handoff_table, rows
from ._records import BenchResult
from ._targets import targets


def to_dict(result: BenchResult) -> dict[str, Any]:
    """Every raw and derived figure, for ``--json``."""
    raw = dataclasses.asdict(result)
    raw["config"]["device"] = str(result.config.device)
    raw["derived"] = {
        "rows": [dataclasses.asdict(r) for ratio in result.ratios for r in rows(result, ratio)],
        "handoff_us": handoff_table(result),
        "targets": [dataclasses.asdict(t) for t in targets(result)],
        "epoch_boundaries": [
            {**dataclasses.asdict(b), "ratio": b.ratio} for b in boundaries(result)
        ],
    }
    return raw


def write_json(result: BenchResult, path: str | Path) -> None:
    """Write :func:`to_dict` as JSON."""
    Path(path).write_text(json.dumps(to_dict(result), indent=2) + "\n")
