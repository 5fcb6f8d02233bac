"""Move a typical image loop's normalisation from the loader to the GPU, and check the numbers.

Before: the dataset decodes an HWC uint8 image (as PIL or OpenCV give it), then makes it a
normalised CHW float32 (torchvision's ``ToTensor`` and ``Normalize``, written out here), and
the loader collates, pins and copies four bytes per value.

After: the dataset returns the uint8 image, ``collate_fn=nostall.collate_uint8`` stacks it, and
``nostall.prefetch(..., transform=T.Normalize(mean, std))`` normalises on the device, on the
copy stream. The script runs both, checks that every batch matches, and prints what moved.

    python examples/gpu_normalize.py                 # CUDA if present, else the CPU
    python examples/gpu_normalize.py --device cpu --batches 8
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall import transforms as T

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class DecodedImages(Dataset[tuple[Any, int]]):
    """HWC uint8 images, as a JPEG decoder gives them; ``normalize`` does the CPU-side work."""

    def __init__(self, length: int, size: int, normalize: bool) -> None:
        self.length, self.size, self.normalize = length, size, normalize
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, int]:
        rng = np.random.default_rng(i)
        image = rng.integers(0, 256, (self.size, self.size, 3), dtype=np.uint8)  # "decoded"
        if not self.normalize:
            return image, i % 10
        # ToTensor: HWC uint8 -> CHW float in [0, 1]; then Normalize.
        tensor = torch.from_numpy(image).permute(2, 0, 1).contiguous().float().div(255)
        return (tensor - self.mean) / self.std, i % 10


def main(argv: list[str] | None = None) -> int:
    """Run both loops over the same images; return 0 when every batch matched."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: the GPU)")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    length = args.batches * args.batch_size

    def loader(normalize: bool) -> DataLoader[Any]:
        return DataLoader(
            DecodedImages(length, args.size, normalize),
            batch_size=args.batch_size,
            num_workers=args.workers,
            collate_fn=None if normalize else nostall.collate_uint8,
        )

    before = nostall.prefetch(loader(True), device)
    after = nostall.prefetch(loader(False), device, transform=T.Normalize(MEAN, STD))
    start = time.perf_counter()
    expected = [images.cpu() for images, _ in before]
    before_s = time.perf_counter() - start
    start = time.perf_counter()
    worst = 0.0
    for (images, _), reference in zip(after, expected, strict=True):
        worst = max(worst, float((images.cpu() - reference).abs().max()))
    after_s = time.perf_counter() - start
    per_batch = args.batch_size * 3 * args.size * args.size
    print(f"device {device}: {args.batches} batches of {args.batch_size} x {args.size}^2 images")
    print(f"  normalised in the loader: {4 * per_batch:>11,} bytes/batch  {before_s:.3f} s")
    print(f"  normalised on the device: {per_batch:>11,} bytes/batch  {after_s:.3f} s")
    print(f"  largest difference between the two: {worst:.2g}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
