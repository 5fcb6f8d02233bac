"""The GPU regime's launch slowdown beside ``threads=`` or worker processes, one process a way.

The loop of ``nostall bench``'s GPU-regime trial, alone: each step launches ``--launch-ops``
small torch ops (``DeviceStep``), then waits without the GIL until ``--device-ms`` has passed
since it began. Loading is the bench's JPEG samples (``--sleep-ms`` > 0: a GIL-free sample
instead, one ``time.sleep`` each, so that what is left is nostall's own work). Per epoch: the
median launch phase over the launch phase alone just before it (the launch slowdown), and E,
the epoch time over (batches x device time). Run it with ``PYTHONPATH`` at each version to
compare, alternating, at the same ``--device-ms``: loading has slack when a batch loads in
less than a step, and none (E > 1) when it does not.

Run: PYTHONPATH=src .venv/bin/python benchmarks/launch_pacing.py --way threads --device-ms 25
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall.bench._workloads import DeviceStep, JpegImages, jpeg_files


class Idle(Dataset[tuple[torch.Tensor, int]]):
    """Samples that only sleep (no GIL held): one GIL take each, on waking."""

    def __init__(self, length: int, sleep_s: float) -> None:
        self.length, self.sleep_s = length, sleep_s
        self.pixels = torch.zeros(3, 64, 64, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.sleep_s)
        return self.pixels, index % 10


def main() -> None:
    """Epochs of the regime loop through one way of loading; a line per epoch, then medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--way", choices=("threads", "workers"), default="threads")
    parser.add_argument("--loaders", type=int, default=2, help="threads= or num_workers=")
    parser.add_argument("--batches", type=int, default=48, help="per epoch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3, help="timed, after one untimed")
    parser.add_argument("--device-ms", type=float, default=25.0)
    parser.add_argument("--launch-ops", type=int, default=1000)
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="> 0: GIL-free samples")
    parser.add_argument("--switch-ms", type=float, default=None, help="sys.setswitchinterval")
    args = parser.parse_args()
    if args.switch_ms:
        sys.setswitchinterval(args.switch_ms / 1e3)
    torch.set_num_threads(1)  # as the bench's CPU regime: the cores are left to loading
    length = args.batches * args.batch_size
    dataset: Dataset[Any] = (
        Idle(length, args.sleep_ms / 1e3)
        if args.sleep_ms > 0
        else JpegImages(jpeg_files(None, 64), 224, length)
    )
    step = DeviceStep(args.launch_ops, args.device_ms / 1e3)
    probe = next(iter(DataLoader(dataset, args.batch_size)))
    loop: Any = (
        nostall.prefetch(DataLoader(dataset, args.batch_size), "cpu", threads=args.loaders)
        if args.way == "threads"
        else DataLoader(dataset, args.batch_size, num_workers=args.loaders, persistent_workers=True)
    )
    for batch in loop:  # untimed: threads and workers started, nostall's pacing seen steps
        step(batch)
    load = os.getloadavg()[0]
    slowdowns, efficiencies = [], []
    for epoch in range(args.epochs):
        step(probe)
        alone = statistics.median(step(probe) for _ in range(5))
        launches = []
        start = time.perf_counter()
        for batch in loop:
            launches.append(step(batch))
        elapsed = time.perf_counter() - start
        slowdowns.append(statistics.median(launches) / alone)
        efficiencies.append(elapsed / (len(launches) * step.device_s))
        print(
            f"epoch {epoch}: launch alone {alone * 1e3:.2f} ms, slowdown "
            f"{slowdowns[-1]:.2f}x, E {efficiencies[-1]:.2f}"
        )
    print(
        f"{args.way} {args.loaders}, device {args.device_ms:g} ms, switch interval "
        f"{sys.getswitchinterval() * 1e3:g} ms, load {load:.2f} -> {os.getloadavg()[0]:.2f}: "
        f"launch slowdown {statistics.median(slowdowns):.2f}x, "
        f"E {statistics.median(efficiencies):.2f}"
    )


if __name__ == "__main__":
    main()
