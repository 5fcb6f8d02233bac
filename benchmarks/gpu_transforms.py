"""Normalising images in the loader (CPU) against on the device (``nostall.transforms``).

The same (H, W, C) uint8 images, as decoders give them, either become normalised (C, H, W)
float32 in the dataset (torchvision's ``ToTensor`` then ``Normalize``; collated, pinned and
copied at four bytes per value), or are stacked by ``collate_uint8``, cross as uint8 and are
normalised by ``nostall.transforms.Normalize`` on the copy stream. Prints samples/s by loader
workers (median and min-max of the repeats), bytes per sample, and the largest difference
between the two ways' first batches; exits 1 when that exceeds 1e-5.

Run: .venv/bin/python benchmarks/gpu_transforms.py [--device cuda] [--image-size 128]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall import transforms as T
from nostall._loading.collate import collate_uint8
from nostall.bench._workloads import SyntheticImages, train_step

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CPU_SIDE, DEVICE_SIDE = "CPU-side normalise (in the loader)", "device-side normalise (nostall)"


class Decoded(Dataset[tuple[torch.Tensor, int]]):
    """The images as decoders give them: (H, W, C) uint8."""

    def __init__(self, images: Dataset[tuple[torch.Tensor, int]]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.images[index]
        return image.permute(1, 2, 0).contiguous(), label


class NormalizedOnCpu(Dataset[tuple[torch.Tensor, int]]):
    """Each (H, W, C) uint8 image becomes a normalised (C, H, W) float32 in the loader."""

    def __init__(self, images: Dataset[tuple[torch.Tensor, int]]) -> None:
        self.images = images
        self.mean, self.std = torch.tensor(MEAN).view(-1, 1, 1), torch.tensor(STD).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.images)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self.images[index]
        return (image.permute(2, 0, 1).float() / 255 - self.mean) / self.std, label


def main() -> int:
    """Measure both ways; exit status 1 when they disagree beyond float32 rounding."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    step = train_step(16, device)
    # Decoding (hashing, as a decoder would) costs about 0.5 ms per sample.
    count = args.batches * args.batch_size
    images = Decoded(SyntheticImages(count, size=args.image_size, decode_ms=0.5))
    normalize = T.Normalize(MEAN, STD)

    def loader(way: str, workers: int) -> DataLoader[Any]:
        on_cpu = way == CPU_SIDE
        return DataLoader(
            NormalizedOnCpu(images) if on_cpu else images,
            batch_size=args.batch_size,
            num_workers=workers,
            pin_memory=cuda and workers > 0,
            persistent_workers=workers > 0,
            collate_fn=None if on_cpu else collate_uint8,
        )

    on_cpu, as_bytes = (next(iter(loader(way, 0)))[0] for way in (CPU_SIDE, DEVICE_SIDE))
    diff = float((normalize(as_bytes.to(device)).cpu() - on_cpu).abs().max())
    counts = [0, *(w for w in (1, 2, 4, 8) if w < (os.cpu_count() or 1))]
    table = Table(title=f"samples/s by loader workers on {device}, {args.image_size}px images")
    table.add_column("way")
    for count in counts:
        table.add_column(f"{count} workers", justify="right")
    table.add_column("bytes/sample", justify="right")
    for way, batch in ((CPU_SIDE, on_cpu), (DEVICE_SIDE, as_bytes)):
        cells = []
        for workers in counts:
            transform = None if way == CPU_SIDE else normalize
            feed = nostall.prefetch(loader(way, workers), device, transform=transform)
            rates = []
            for repeat in range(-1, args.repeats):  # -1: warm-up, the workers start
                start, samples = time.perf_counter(), 0
                for pixels, labels in feed:
                    step((pixels, labels))
                    samples += len(labels)
                if repeat >= 0:
                    rates.append(samples / (time.perf_counter() - start))
            feed.close()
            del feed
            gc.collect()
            cells.append(f"{statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})")
        table.add_row(way, *cells, f"{batch.element_size() * batch[0].numel():,}")
    console = Console()
    # Piped output is 80 columns wide: with a column per worker count on a many-core machine
    # rich would cut the ways' names and the figures short. As wide as the table needs.
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    console.width = max(console.width, natural)
    console.print(table)
    console.print(f"largest difference between the two ways' first batches: {diff:.2g}")
    return 0 if diff <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
