"""What crossing an epoch boundary costs each way of loading, against its steady batch interval.

The interval from an epoch's last batch to the next one's first shows what a way pays at the
boundary: worker start-up, an empty pipeline. Prints, per way, that interval over the median
interval within epochs (median and min-max over the boundaries; 1 is seamless). The synthetic
workload of ``nostall bench``: loading a batch costs RATIO times the step.

Run: .venv/bin/python benchmarks/epoch_boundaries.py [--epochs 5] [--ratio 0.5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

import nostall
from nostall.bench._contenders import moved
from nostall.bench._workloads import SyntheticImages, train_step


def main() -> None:
    """Time every way over ``--epochs`` epochs and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda, cores = device.type == "cuda", os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // 2))
    workers = max(1, cores - torch.get_num_threads())
    step = train_step(16, device)
    # On the device, as every way below hands batches to the step: the step alone is timed.
    probe = (
        torch.zeros(args.batch_size, 3, 64, 64, dtype=torch.uint8, device=device),
        torch.zeros(args.batch_size, dtype=torch.long, device=device),
    )
    step_s = min(_timed(lambda: step(probe)) for _ in range(10))
    decode_ms = args.ratio * step_s * 1e3 / args.batch_size
    dataset = SyntheticImages(args.batches * args.batch_size, decode_ms=decode_ms)

    def loader(persistent: bool) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=args.batch_size,
            num_workers=workers,
            pin_memory=cuda,
            persistent_workers=persistent,
        )

    ways: dict[str, Callable[[], Any]] = {
        "DataLoader, workers restarted": lambda: moved(loader(False), device, cuda),
        "DataLoader, persistent workers": lambda: moved(loader(True), device, cuda),
        "nostall": lambda: nostall.prefetch(loader(True), device),
        "nostall across_epochs": lambda: nostall.prefetch(loader(True), device, across_epochs=True),
    }
    table = Table(
        title=f"epoch boundaries over {args.epochs} epochs at ratio {args.ratio:g} on {device}"
    )
    for column in ("way", "boundary / steady interval", "steady ms"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for name, make in ways.items():
        loop = make()
        intervals: list[list[float]] = []
        last = time.perf_counter()
        for _ in range(args.epochs):
            intervals.append([])
            for batch in loop:
                now = time.perf_counter()
                intervals[-1].append(now - last)
                last = now
                step(batch)
        steady = statistics.median(x for epoch in intervals for x in epoch[1:])
        ratios = [epoch[0] / steady for epoch in intervals[1:]]
        cell = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        table.add_row(name, cell, f"{steady * 1e3:.1f}")
        if hasattr(loop, "close"):
            loop.close()
        del loop
        gc.collect()  # the workers stop before the next way starts its own
    Console().print(table)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
