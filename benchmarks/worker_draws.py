"""What recording the draws of a DataLoader's workers costs (what resumes them exactly).

nostall iterates a loader with workers through a ``collate_fn`` that stamps each batch, in
its worker, with that worker's generators (torch's, Python's ``random``, NumPy's: about 0.1 ms
a batch, NumPy's most of it), and takes the stamp off in the process that trains. Ways,
alternating, each a median with its spread over ``--repeats`` epochs, over a loader with 2
persistent workers: the plain loop, ``nostall.prefetch`` as it is (recording), and
``nostall.prefetch`` with the recording switched off (what nostall did before it resumed the
workers' draws). Two workloads: the bench's augmented JPEG images (decode, crop, flip: a
realistic batch, milliseconds per sample) and tiny tensors with one draw each (the worst case:
a batch loads in well under a millisecond, so a fixed cost per batch shows). No step runs
between batches: the loop only takes them, so the loader's own speed is what is timed.

Run: .venv/bin/python benchmarks/worker_draws.py [--repeats 7] [--jpeg-batches 24]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._sources.sources import SourceKind
from nostall.bench._workloads import AugmentedJpegImages, jpeg_files


class TinyDrawing(Dataset[torch.Tensor]):
    """``n`` samples of 3 x 8 x 8 random values: one draw from torch each, nothing to decode."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(3, 8, 8) + i


@contextlib.contextmanager
def recording_off() -> Iterator[None]:
    """nostall as before it recorded the workers' draws: every loader taken for one it cannot."""
    saved = SourceKind.records_worker_draws
    SourceKind.records_worker_draws = property(lambda self: False)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        SourceKind.records_worker_draws = saved  # type: ignore[method-assign]


def epoch(batches: Iterable[Any]) -> float:
    """Seconds to take one epoch of ``batches``."""
    start = time.perf_counter()
    for _ in batches:
        pass
    return time.perf_counter() - start


def measure_one(name: str, loader: DataLoader[Any], repeats: int) -> None:
    """Time the three ways over ``loader``, alternating, and print a line each."""
    seconds: dict[str, list[float]] = {"plain loop": [], "nostall": [], "nostall, unrecorded": []}
    epoch(loader)  # the workers started, the files in the page cache
    recorded = nostall.prefetch(loader, "cpu")
    epoch(recorded)
    with recording_off():
        unrecorded = nostall.prefetch(DataLoader(**_arguments(loader)), "cpu")
        epoch(unrecorded)
    load = os.getloadavg()[0]
    for _ in range(repeats):
        seconds["plain loop"].append(epoch(loader))
        seconds["nostall"].append(epoch(recorded))
        with recording_off():
            seconds["nostall, unrecorded"].append(epoch(unrecorded))
    recorded.close()
    unrecorded.close()
    batches = len(loader)
    print(
        f"{name}: {batches} batches an epoch, {repeats} epochs each, alternating; load "
        f"average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    base = statistics.median(seconds["nostall, unrecorded"])
    for way, values in seconds.items():
        median = statistics.median(values)
        ratios = sorted(v / u for v, u in zip(values, seconds["nostall, unrecorded"], strict=True))
        print(
            f"  {way:20} {median * 1e3 / batches:7.3f} ms a batch "
            f"({min(values) * 1e3 / batches:.3f}-{max(values) * 1e3 / batches:.3f})  "
            f"{median / base:.3f}x the unrecorded time (per epoch {ratios[0]:.3f}-{ratios[-1]:.3f})"
        )


def _arguments(loader: DataLoader[Any]) -> dict[str, Any]:
    """What builds another loader like ``loader`` (its own workers)."""
    return {
        "dataset": loader.dataset,
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "persistent_workers": loader.persistent_workers,
    }


def main(argv: list[str] | None = None) -> None:
    """Both workloads, with the command line's arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--jpeg-batches", type=int, default=24)
    parser.add_argument("--tiny-batches", type=int, default=200)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--jpeg-cache", default=None)
    args = parser.parse_args(argv)
    paths = jpeg_files(args.jpeg_cache, 64)
    images = AugmentedJpegImages(paths, args.size, 16 * args.jpeg_batches)
    measure_one(
        "augmented JPEG, batches of 16, 2 persistent workers",
        DataLoader(images, batch_size=16, num_workers=2, persistent_workers=True),
        args.repeats,
    )
    tiny = TinyDrawing(32 * args.tiny_batches)
    measure_one(
        "tiny tensors, batches of 32, 2 persistent workers",
        DataLoader(tiny, batch_size=32, num_workers=2, persistent_workers=True),
        args.repeats,
    )


if __name__ == "__main__":
    main()
