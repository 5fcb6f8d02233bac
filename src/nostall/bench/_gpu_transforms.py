"""``--gpu-transforms``: normalising images in the loader (CPU) against on the device (nostall)."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._prefetcher import prefetch
from .._timing import timeit
from ._config import BenchConfig
from ._progress import Progress
from ._sweep import time_epoch
from ._workload import NormalizedOnCpu, SmallConvNet, SyntheticImages, make_train_step, time_step

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
TRANSFORM_WAYS = ("CPU-side normalise (in the loader)", "device-side normalise (nostall)")


def worker_counts(most: int) -> list[int]:
    """The loader worker counts the trial tries: none, then 1, 2, 4, ... up to ``most``."""
    return [0, *[w for w in (1, 2, 4, 8, 16) if w <= most]]


def run_transforms(
    config: BenchConfig, workers: int, device: torch.device, hash_rate: float, progress: Progress
) -> dict[str, Any]:
    """What moving normalisation to the device saves: loader CPU, workers, bytes; same numbers.

    The same (H, W, C) uint8 images (``transform_image_size``), as decoders give them, either
    become normalised (C, H, W) float32 in the loader (torchvision's ``ToTensor`` then
    ``Normalize``; collated, pinned and copied at four bytes per value) or are stacked by
    ``collate_uint8``, cross as uint8 and are normalised by ``nostall.transforms.Normalize``
    on the device, on the copy stream.

    Measured for each way: the loader's CPU time per sample in one thread with one intra-op
    thread (what a worker spends: dataset, normalising, collating); the device-side work per
    sample (``Normalize`` on a device batch, CUDA events on a GPU); samples/s with 0, 1, 2,
    4, ... loader workers under ``nostall.prefetch``; and the largest difference between the
    two ways' first batches.
    """
    from .. import transforms as T
    from .._collate import collate_uint8

    size = config.transform_image_size
    model = SmallConvNet(config.width).to(device)
    train_step = make_train_step(model, device)

    def step(batch: Any) -> float:
        # The model takes plain NCHW either way: device-side batches of HWC images arrive
        # channels-last, which changes the convolutions' speed, not the loading compared here.
        images, labels = batch
        return train_step((images.contiguous(), labels))

    floats = torch.zeros(config.batch_size, 3, size, size, device=device)
    labels = torch.zeros(config.batch_size, dtype=torch.int64, device=device)
    compute_s = time_step(step, (floats, labels), device, 20)
    # Loading (decoding) costs a quarter of the step, so that normalising decides the outcome.
    base = SyntheticImages(
        config.batches * config.batch_size,
        image_size=size,
        decode_ms=0.25 * compute_s * 1e3 / config.batch_size,
        hash_bytes_per_ms=hash_rate,
        layout="hwc",  # as decoders give them: the CPU-side way also transposes (ToTensor)
    )
    cuda = device.type == "cuda"
    normalize = T.Normalize(MEAN, STD)

    def loader(way: str, count: int, pin: bool) -> DataLoader[Any]:
        if way == TRANSFORM_WAYS[0]:
            return DataLoader(
                NormalizedOnCpu(base, MEAN, STD),
                batch_size=config.batch_size,
                num_workers=count,
                pin_memory=pin,
                persistent_workers=count > 0,
            )
        return DataLoader(
            base,
            batch_size=config.batch_size,
            num_workers=count,
            pin_memory=pin,
            persistent_workers=count > 0,
            collate_fn=collate_uint8,
        )

    out: dict[str, Any] = {
        "image_size": size,
        "compute_samples_per_s": config.batch_size / compute_s,
        "bytes_per_sample": {
            TRANSFORM_WAYS[0]: 3 * size * size * 4,
            TRANSFORM_WAYS[1]: 3 * size * size,
        },
        "loader_ms_per_sample": {
            way: _loader_cpu_ms_per_sample(loader(way, 0, False)) for way in TRANSFORM_WAYS
        },
        "rates": {},
    }
    on_cpu, as_uint8 = (next(iter(loader(way, 0, False)))[0] for way in TRANSFORM_WAYS)
    device_input = as_uint8.to(device)
    out["max_abs_diff"] = float((normalize(device_input).cpu() - on_cpu).abs().max())
    per_batch = timeit(lambda: normalize(device_input), repeat=20, warmup=3, device=device)
    out["device_ms_per_sample"] = {
        TRANSFORM_WAYS[0]: 0.0,
        TRANSFORM_WAYS[1]: per_batch.median * 1e3 / config.batch_size,
    }
    for way in TRANSFORM_WAYS:
        rates: dict[int, float] = {}
        for count in worker_counts(workers):
            transform = None if way == TRANSFORM_WAYS[0] else normalize
            feed = prefetch(loader(way, count, cuda), device, transform=transform)
            time_epoch(feed, step, device)  # warm-up: workers start, caches fill
            epoch, _ = time_epoch(feed, step, device)
            rates[count] = config.batches * config.batch_size / epoch
            feed.close()
            del feed
            gc.collect()
            progress.step(f"transforms: {way}, {count} workers")
        out["rates"][way] = rates
    return out


def _loader_cpu_ms_per_sample(loader: DataLoader[Any]) -> float:
    """CPU milliseconds per sample to load ``loader`` in this thread, as one worker would.

    Thread CPU time, with one intra-op thread (a worker's setting), best of two passes.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(2):
            start, samples = time.thread_time(), 0
            for images, _labels in loader:
                samples += len(images)
            best = min(best, time.thread_time() - start)
        return best * 1e3 / samples
    finally:
        torch.set_num_threads(threads)
