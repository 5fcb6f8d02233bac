"""JPEGs decoded on the device (``DecodeJPEG``) against the best-practice DataLoader.

The same JPEG files (the bench's: about 400 x 350, photograph-like), the same augmentation
(a random resized crop to ``--size``, a flip, then ``Normalize`` on the device), two ways:

* ``dataloader:W``: ``DataLoader(num_workers=W, pin_memory=True)`` decoding, cropping and
  flipping with Pillow in its workers (crops drawn from torch's global generator, as
  torchvision's are), uint8 batches copied to the device and normalised there;
* ``decode:W``: ``nostall.prefetch`` over ``DataLoader(ImageBytes, num_workers=W,
  collate_fn=collate_encoded)``, decoded by ``DecodeJPEG`` on the copy stream (nvJPEG on CUDA,
  Pillow on the CPU), then ``RandomResizedCrop(antialias=True)``, the flip and ``Normalize``.

Each way runs one epoch per repeat, the ways alternating; the consumer only reads each batch
(a sum on the device), so the figure is how fast a way can feed. Per way: samples/s, and the
CPU cores it kept busy (this process's and its workers' CPU time over the epoch's wall time,
the workers counted once they exit at the epoch's end) per 1,000 samples/s. Prints a table;
``--json PATH`` writes the figures.

Run on a GPU machine: python benchmarks/gpu_decode.py --ways dataloader:8,decode:2,decode:4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

import nostall
from nostall import transforms as T
from nostall.bench._workloads import AugmentedJpegImages, jpeg_files

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # workers joined at epoch end
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def loader_for(way: str, paths: list[Any], args: argparse.Namespace, device: torch.device) -> Any:
    """The re-iterable of device batches ``(images, labels)`` of ``way``."""
    kind, _, workers_text = way.partition(":")
    workers = int(workers_text or 0)
    cuda = device.type == "cuda"
    if kind == "dataloader":
        images = AugmentedJpegImages(paths, args.size, args.images)
        loader = DataLoader(images, args.batch_size, num_workers=workers, pin_memory=cuda)
        return nostall.prefetch(loader, device, transform=T.Normalize(MEAN, STD), depth=2)
    if kind == "decode":
        count = len(paths)
        files = T.ImageBytes([(paths[i % count], i % 10) for i in range(args.images)])
        encoded = DataLoader(
            files, args.batch_size, num_workers=workers, collate_fn=T.collate_encoded
        )
        pipeline = T.Compose(
            [
                T.DecodeJPEG(),
                T.RandomResizedCrop(args.size, scale=(0.35, 1.0), antialias=True),
                T.RandomHorizontalFlip(),
                T.Normalize(MEAN, STD),
            ]
        )
        return nostall.prefetch(encoded, device, transform=pipeline, depth=2)
    raise SystemExit(f"--ways: unknown way {way!r}; use dataloader:W or decode:W")


def epoch(batches: Any, device: torch.device) -> tuple[int, float, float]:
    """One epoch: samples, wall seconds, CPU seconds (process and workers)."""
    samples, total = 0, torch.zeros((), device=device)
    cpu, start = _cpu_seconds(), time.perf_counter()
    for images, labels in batches:
        total += images.sum()
        samples += len(labels)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    return samples, wall, _cpu_seconds() - cpu


def main() -> int:
    """Measure the ways; print the table (and write the JSON); exit 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ways", default="dataloader:8,decode:2,decode:4")
    parser.add_argument("--images", type=int, default=2048, help="images per epoch")
    parser.add_argument("--files", type=int, default=256, help="distinct JPEG files, cycled")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jpeg-cache", default=None)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    paths = jpeg_files(args.jpeg_cache, args.files)
    ways = [w for w in args.ways.split(",") if w]
    loaders = {way: loader_for(way, paths, args, device) for way in ways}
    for loader in loaders.values():  # warm up: the decoder's start, the first allocations
        for _ in zip(range(2), loader, strict=False):
            pass
    load = [os.getloadavg()[0]]
    rates: dict[str, list[float]] = {w: [] for w in ways}
    cores: dict[str, list[float]] = {w: [] for w in ways}
    for _ in range(args.repeats):
        for way, loader in loaders.items():
            samples, wall, cpu = epoch(loader, device)
            rates[way].append(samples / wall)
            cores[way].append(cpu / wall)
    load.append(os.getloadavg()[0])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{name}, {os.cpu_count()} CPUs, {args.images} images of {len(paths)} files per epoch, "
        f"batches of {args.batch_size}, {args.repeats} repeats; load {load[0]:.1f} -> {load[1]:.1f}"
    )
    print(f"{'way':<16}{'samples/s':>24}{'cores busy':>20}{'cores per 1000/s':>20}")
    figures = {}
    for way in ways:
        rate, busy = statistics.median(rates[way]), statistics.median(cores[way])
        spread = f"{rate:,.0f} ({min(rates[way]):,.0f}-{max(rates[way]):,.0f})"
        per = busy / (rate / 1000)
        print(f"{way:<16}{spread:>24}{busy:>20.2f}{per:>20.2f}")
        figures[way] = {"samples_per_s": rates[way], "cores": cores[way], "per_1000": per}
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": name, "load": load, "args": vars(args), "ways": figures}, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
