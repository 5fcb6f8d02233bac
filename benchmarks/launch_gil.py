"""Which loading work slows the training thread's launches: the GIL, part by part.

The GPU regime's launch phase (``nostall.bench``'s ``DeviceStep``: small torch ops, each
releasing the GIL inside torch and taking it back, a little Python between them) is timed
alone and beside background threads that each repeat one part of loading a JPEG sample:

- ``sleep``: ``time.sleep(1 ms)``, no GIL held (the control);
- ``decode``: ``Image.open`` and ``convert("RGB")`` (libjpeg);
- ``resize``: the crop and resize of a decoded image (PIL);
- ``to_tensor``: ``tobytes`` and ``torch.frombuffer`` of a resized image;
- ``sample``: the whole ``JpegImages.__getitem__`` (what ``threads=`` runs per sample);
- ``python``: a pure-Python loop (holds the GIL but for the switch interval).

For each: the median launch time over ``--launches`` launches, the background threads running,
over the median alone measured in the same round (rounds alternate the kinds). A part that
holds the GIL long between its releases makes each of the launch's takes wait.

Run: .venv/bin/python benchmarks/launch_gil.py [--threads 2] [--rounds 1] [--launches 5]

More launches take far longer than their count suggests: beside threads that wake often, a
launch phase can be starved for seconds (30 launches a round did not finish in 10 minutes on
the 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from nostall.bench._workloads import DeviceStep, JpegImages, jpeg_files


def parts(images: JpegImages) -> dict[str, Callable[[int], Any]]:
    """One part of loading a sample per kind, by index."""
    from PIL import Image

    path = images.paths[0]
    with Image.open(path) as opened:
        decoded = opened.convert("RGB")
    resized = decoded.resize((224, 224), Image.Resampling.BILINEAR)

    def decode(i: int) -> Any:
        with Image.open(images.paths[i % len(images.paths)]) as image:
            return image.convert("RGB")

    def python(i: int) -> int:
        total = 0
        for k in range(20_000):
            total += (k * i) % 7
        return total

    return {
        "sleep": lambda i: time.sleep(0.001),
        "decode": decode,
        "resize": lambda i: decoded.resize((224, 224), Image.Resampling.BILINEAR),
        "to_tensor": lambda i: torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8),
        "sample": images.__getitem__,
        "python": python,
    }


def launches(step: DeviceStep, batch: Any, count: int) -> float:
    """The median seconds of ``count`` launch phases."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step.launch(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def beside(work: Callable[[int], Any], threads: int, measure: Callable[[], float]) -> float:
    """``measure()`` while ``threads`` background threads repeat ``work``."""
    stop = threading.Event()

    def loop(offset: int) -> None:
        i = offset
        while not stop.is_set():
            work(i)
            i += threads

    running = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
    for thread in running:
        thread.start()
    time.sleep(0.05)  # every thread under way
    try:
        return measure()
    finally:
        stop.set()
        for thread in running:
            thread.join()


def main() -> None:
    """Time the launch phase alone and beside each kind of loading work, rounds alternating."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--launches", type=int, default=5)
    parser.add_argument("--launch-ops", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    images = JpegImages(jpeg_files(None, 64), 224)
    kinds = parts(images)
    step = DeviceStep(args.launch_ops)
    batch = (torch.zeros(8, 3, 224, 224, dtype=torch.uint8), torch.zeros(8, dtype=torch.long))
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds}
    load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for kind, work in kinds.items():
            alone = launches(step, batch, args.launches)
            slowed = beside(work, args.threads, lambda: launches(step, batch, args.launches))
            ratios[kind].append(slowed / alone)
    print(
        f"launch phase ({args.launch_ops} small torch ops) beside {args.threads} threads, over "
        f"alone; medians (min-max) of {args.rounds} rounds; Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, switch interval {sys.getswitchinterval() * 1e3:g} ms; "
        f"load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    for kind, values in ratios.items():
        print(
            f"  {kind:10s} {statistics.median(values):5.2f}x ({min(values):.2f}-{max(values):.2f})"
        )


if __name__ == "__main__":
    main()
