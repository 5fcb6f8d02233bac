"""Host-to-device GB/s on CUDA: raw pinned and pageable copies, and nostall moving such batches.

Each way is timed by ``torch.utils.benchmark`` (``blocked_autorange``; CUDA is synchronised
by the timer) and shown by ``Compare``, then as GB/s: median and min-max over the timed blocks.

Run on a machine with a GPU: .venv/bin/python benchmarks/h2d.py [--mb 8,32,128]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils import benchmark

import nostall

COPIES = 8  # batches per nostall epoch


def main() -> int:
    """Measure every size; exit status 1 without a GPU."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", default="8,32,128", help="megabytes per copy, comma-separated")
    parser.add_argument("--min-run-time", type=float, default=0.5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/h2d.py needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    measurements, rows = [], []
    for megabytes in (float(mb) for mb in args.mb.split(",")):
        numel = int(megabytes * 1e6) // 4
        pinned, pageable = torch.ones(numel).pin_memory(), torch.ones(numel)
        scope: dict[str, Any] = {
            "target": torch.empty(numel, device=device),
            "pinned": pinned,
            "pageable": pageable,
            # One prefetcher per source, reused: each timed run is one of its epochs.
            "over_pinned": nostall.prefetch([pinned] * COPIES, device),
            "over_pageable": nostall.prefetch([pageable] * COPIES, device),
        }
        for name, stmt, batches in (
            ("raw pinned copy", "target.copy_(pinned, non_blocking=True)", 1),
            ("raw pageable copy", "target.copy_(pageable, non_blocking=True)", 1),
            ("nostall, pinned source", "for _ in over_pinned: pass", COPIES),
            ("nostall, pageable source", "for _ in over_pageable: pass", COPIES),
        ):
            timer = benchmark.Timer(
                stmt,
                globals=scope,
                label="host to device",
                sub_label=name,
                description=f"{megabytes:g} MB",
            )
            measured = timer.blocked_autorange(min_run_time=args.min_run_time)
            measurements.append(measured)
            rates = [batches * numel * 4 / t / 1e9 for t in measured.times]
            rows.append((f"{megabytes:g}", name, rates))
    benchmark.Compare(measurements).print()
    table = Table(title=f"host-to-device GB/s on {torch.cuda.get_device_name(device)}")
    for column in ("MB", "way", "GB/s (min-max)"):
        table.add_column(column)
    for megabytes_text, name, rates in rows:
        cell = f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})"
        table.add_row(megabytes_text, name, cell)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
