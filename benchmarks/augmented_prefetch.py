"""Prefetching a DataLoader (``num_workers=0``) whose samples draw random crops and flips.

The bench's JPEG files, decoded with PIL, a ``RandomResizedCrop``-style crop and a horizontal
flip drawn from torch's global generator (as torchvision's transforms draw); a training step
that does not draw from that generator and takes about as long as loading a batch: it waits
``--step-ms`` without the GIL, as a loop waits for a GPU step (dropout there draws from
torch.cuda's generator). Ways, alternating, each a median with its spread over ``--repeats``
epochs: the plain loop over the loader, and ``nostall.prefetch(loader)``, which watches the
loop between two batches, sees it draw from none of the source's generators, and loads ahead
with the plain loop's draws (checked here: the batches of both ways are equal).

Run: .venv/bin/python benchmarks/augmented_prefetch.py [--batches 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

import nostall
from nostall.bench._workloads import AugmentedJpegImages, jpeg_files


def epoch(batches: Iterable[Any], step_s: float) -> tuple[float, list[torch.Tensor]]:
    """Seconds for one epoch of ``batches`` with a step that waits ``step_s``; the images."""
    torch.manual_seed(0)
    seen = []
    start = time.perf_counter()
    for images, _ in batches:
        seen.append(images)
        time.sleep(step_s)  # the device computes; the CPU thread waits, without the GIL
    return time.perf_counter() - start, seen


def measure(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Print the table; return the seconds per epoch of each way."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=None, help="default: a batch's load")
    parser.add_argument("--jpeg-cache", default=None)
    args = parser.parse_args(argv)
    paths = jpeg_files(args.jpeg_cache, 64)
    dataset = AugmentedJpegImages(paths, args.size, args.batches * args.batch_size)
    loader = DataLoader(dataset, batch_size=args.batch_size)
    load_s = epoch(loader, 0.0)[0] / args.batches  # also warms the files into the page cache
    step_s = load_s if args.step_ms is None else args.step_ms / 1e3
    load = os.getloadavg()[0]
    seconds: dict[str, list[float]] = {"plain loop": [], "nostall.prefetch": []}
    for _ in range(args.repeats):
        plain_s, plain = epoch(loader, step_s)
        prefetcher = nostall.prefetch(loader, "cpu")
        ours_s, ours = epoch(prefetcher, step_s)
        state = prefetcher._lineage.epochs.draws.state.value
        prefetcher.close()
        if any(not torch.equal(a, b) for a, b in zip(plain, ours, strict=True)):
            raise SystemExit("nostall.prefetch gave other batches than the plain loop")
        seconds["plain loop"].append(plain_s)
        seconds["nostall.prefetch"].append(ours_s)
    print(
        f"{args.batches} batches of {args.batch_size} augmented JPEG samples, load "
        f"{load_s * 1e3:.1f} ms a batch, step {step_s * 1e3:.1f} ms; {args.repeats} epochs "
        f"each, alternating; load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} "
        f"at the end; nostall's watch ended {state!r}; the batches equal"
    )
    plain_median = statistics.median(seconds["plain loop"])
    for way, values in seconds.items():
        ratios = sorted(p / v for p, v in zip(seconds["plain loop"], values, strict=True))
        print(
            f"  {way:18} {statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"
            f"  {plain_median / statistics.median(values):.2f}x the plain loop "
            f"(per repeat {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )
    return seconds


def main() -> None:
    """``measure()`` with the command line's arguments."""
    measure()


if __name__ == "__main__":
    main()
