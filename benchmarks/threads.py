"""Loading with threads against worker processes: samples/s, first batch, memory added.

Three workloads behind a realistic dataset object, 200,000 (path, label) pairs:

- ``jpeg``: the bench's JPEG files (cycled), decoded with PIL, cropped as ``RandomResizedCrop``
  does and resized to 224 x 224: native code that releases the GIL;
- ``augmented``: the ``jpeg`` samples with torchvision's usual augmentations, a random resized
  crop and a horizontal flip drawn from torch's global generator (``torch.rand``,
  ``torch.randint``, ``Tensor.uniform_``), as torchvision's transforms draw;
- ``python``: pure-Python arithmetic in ``__getitem__`` (about 1 ms), which holds the GIL;
- ``sleep``: ``__getitem__`` waits 10 ms without the GIL, as a read from a network file system
  or an object store does (run it with ``--batch-size 1`` for detection-style small batches);
- ``stream``: the ``jpeg`` samples read as a stream, an ``IterableDataset`` of 16 shards that
  gives each worker (or loading thread) every N-th shard, as webdataset and Hugging Face
  streaming do; only the serial DataLoader, its workers and nostall's threads apply.

Ways: the serial DataLoader; DataLoader ``num_workers=1..W`` (W: the cores);
``nostall.prefetch(threads=1..2W)`` over ``num_workers=0``; torchdata.nodes
``ParallelMapper(method="thread")`` with 1..2W threads; SPDL pipelines at concurrency 1..2W
(when spdl is installed). Each run is a fresh process that builds the dataset, then a loader,
and iterates one epoch without a training step (this measures loading): the time to the first
batch, samples/s over the epoch, and the memory loading added: the peak PSS of the process and
its children together (psutil, sampled every 20 ms) minus the PSS before the loader was built.

``--ways serial,workers:2,nostall:6`` runs only those ways (``way:count``).

Run: .venv/bin/python benchmarks/threads.py [--workload jpeg|augmented|python|sleep|stream]
[--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate, get_worker_info

from nostall.bench._workloads import AugmentedJpegImages, JpegImages, jpeg_files

PAIRS = 200_000


class PythonWork(Dataset[tuple[torch.Tensor, int]]):
    """Pure-Python work per sample, holding the GIL, over the same 200,000 (path, label) pairs."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        total = 0
        for k in range(20_000):  # about 1 ms of bytecode
            total += (k * index) % 7
        return torch.full((3, 8, 8), total % 251, dtype=torch.uint8), index % 10


class SleepingReads(Dataset[tuple[torch.Tensor, int]]):
    """Each sample waits 10 ms without the GIL (an I/O read), over 200,000 (path, label) pairs."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.01)
        return torch.full((3, 8, 8), index % 251, dtype=torch.uint8), index % 10


class JpegShards(IterableDataset[tuple[torch.Tensor, int]]):
    """``--workload stream``: ``samples`` JPEG samples in 16 shards, each worker its own."""

    SHARDS = 16

    def __init__(self, images: Dataset[tuple[torch.Tensor, int]], samples: int) -> None:
        self.images, self.per_shard = images, -(-samples // self.SHARDS)

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in range(worker, self.SHARDS, workers):
            for i in range(shard * self.per_shard, (shard + 1) * self.per_shard):
                yield self.images[i]


def dataset(workload: str, cache: str | None) -> Dataset[Any]:
    """200,000 (path, label) pairs cycling over the cached JPEG files, for each workload."""
    if workload == "sleep":  # no file is read: no JPEG cache to make
        return SleepingReads([f"{i:06d}.jpg" for i in range(PAIRS)])
    files = jpeg_files(cache, 256)
    paths = [str(files[i % len(files)]) for i in range(PAIRS)]
    if workload == "augmented":  # torchvision-style draws from torch's global generator
        return AugmentedJpegImages(paths, 224)  # type: ignore[arg-type]
    jpeg = workload in ("jpeg", "stream")
    return JpegImages(paths, 224) if jpeg else PythonWork(paths)  # type: ignore[arg-type]


#: The library each way imports, loaded before the memory baseline (as a training script would).
#: nostall's package loads its modules on first use: its prefetcher (with the loading
#: threads) is what a training script has loaded by the time its epochs run.
LIBRARY = {
    "nostall": "nostall._prefetcher",
    "torchdata": "torchdata.nodes",
    "spdl": "spdl.pipeline",
}


def feed(way: str, count: int, data: Dataset[Any], indices: list[int], batch: int) -> Any:
    """The iterable each way makes of the same samples, in the same batches."""
    if isinstance(data, IterableDataset):  # the stream: no index to fetch
        if way == "nostall":
            import nostall

            return nostall.prefetch(DataLoader(data, batch_size=batch), "cpu", threads=count)
        return DataLoader(data, batch_size=batch, num_workers=count if way == "workers" else 0)
    if way in ("serial", "workers"):
        workers = count if way == "workers" else 0
        return DataLoader(data, batch_size=batch, sampler=indices, num_workers=workers)
    if way == "nostall":
        import nostall

        loader = DataLoader(data, batch_size=batch, sampler=indices)
        return nostall.prefetch(loader, "cpu", threads=count)
    if way == "torchdata":
        import torchdata.nodes as tn

        node: Any = tn.ParallelMapper(
            tn.IterableWrapper(indices), data.__getitem__, num_workers=count, method="thread"
        )
        node = tn.Mapper(tn.Batcher(node, batch_size=batch), default_collate)
        return tn.Loader(node)
    from spdl.pipeline import PipelineBuilder

    builder: Any = PipelineBuilder()
    builder = builder.add_source(indices)
    builder = builder.pipe(data.__getitem__, concurrency=count, output_order="input")
    builder = builder.aggregate(batch).pipe(default_collate).add_sink(3)
    return builder.build(num_threads=count)


def pss() -> int:
    """PSS of this process and all its children, in bytes."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a worker that just ended
            total += proc.memory_full_info().pss
    return total


def one_run(
    workload: str, way: str, count: int, batches: int, batch: int, cache: str | None, memory: bool
) -> dict[str, float]:
    """One epoch of one way, in this (fresh) process: timed, or with its memory sampled.

    Reading PSS costs about 2 ms per process, so the runs that sample it (every 20 ms) are
    not the runs that are timed.
    """
    torch.set_num_threads(1)
    data = dataset(workload, cache)
    # The idle training process has its imports loaded already: PIL, and the library of the way.
    data[0]
    if workload == "stream":
        data = JpegShards(data, batches * batch)
    importlib.import_module(LIBRARY.get(way, "torch"))
    indices = list(range(batches * batch))
    base = pss()
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], pss())

    watcher = threading.Thread(target=watch, daemon=True)
    if memory:
        watcher.start()
    start = time.perf_counter()
    loader = feed(way, count, data, indices, batch)
    if way == "spdl":
        loader.start()
        it = iter(loader.get_iterator(timeout=120))
    else:
        it = iter(loader)
    samples = len(next(it)[1])
    first = time.perf_counter() - start
    for _, labels in it:
        samples += len(labels)
    elapsed = time.perf_counter() - start
    if way == "spdl":
        loader.stop()
    done.set()
    if memory:
        watcher.join()
        return {"added_mib": (peak[0] - base) / 2**20}
    return {"first_s": first, "samples_per_s": samples / elapsed}


def chosen(way: str) -> tuple[str, int]:
    """``--ways``'s ``way:count`` (``serial`` alone)."""
    name, _, count = way.partition(":")
    if name not in ("serial", "workers", "nostall", "torchdata", "spdl"):
        raise SystemExit(f"--ways: no way {name!r}; pass serial, workers:N, nostall:N, ...")
    return name, int(count or 0)


def main() -> None:
    """Run every way in fresh processes, alternating, and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workloads = ("jpeg", "augmented", "python", "sleep", "stream")
    parser.add_argument("--workload", choices=workloads, default="jpeg")
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jpeg-cache", default=None)
    parser.add_argument("--ways", default=None, help="only these, e.g. serial,workers:2,nostall:6")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # way:count:mode, in a child process
    args = parser.parse_args()
    if args.one:
        way, count, mode = args.one.split(":")
        measured = one_run(
            args.workload,
            way,
            int(count),
            args.batches,
            args.batch_size,
            args.jpeg_cache,
            mode == "memory",
        )
        print(json.dumps(measured))
        return
    cores = os.cpu_count() or 1
    ways = [("serial", 0)] + [("workers", w) for w in range(1, cores + 1)]
    ways += [("nostall", t) for t in range(1, 2 * cores + 1)]
    if args.workload != "stream":  # the peers that fetch by index (a stream is read in order)
        ways += [("torchdata", t) for t in range(1, 2 * cores + 1)]
        try:
            import spdl.pipeline  # noqa: F401

            ways += [("spdl", t) for t in range(1, 2 * cores + 1)]
        except ImportError:
            print("spdl is not installed: no SPDL rows", file=sys.stderr)
    if args.ways:
        ways = [chosen(way) for way in args.ways.split(",")]
    results: dict[tuple[str, int], list[dict[str, float]]] = {w: [] for w in ways}
    command = [
        sys.executable,
        __file__,
        "--workload",
        args.workload,
        "--batches",
        str(args.batches),
    ]
    command += ["--batch-size", str(args.batch_size)]
    if args.jpeg_cache:
        command += ["--jpeg-cache", args.jpeg_cache]
    load = os.getloadavg()[0]
    for _ in range(args.repeats):
        for way, count in ways:  # alternating, a fresh process each, timed then sampled
            run: dict[str, float] = {}
            for mode in ("speed", "memory"):
                one = [*command, "--one", f"{way}:{count}:{mode}"]
                out = subprocess.run(one, capture_output=True, text=True, check=True)
                run.update(json.loads(out.stdout.strip().splitlines()[-1]))
            results[(way, count)].append(run)
    from rich.console import Console
    from rich.table import Table

    serial_runs = results.get(("serial", 0), [])
    serial = statistics.median(r["samples_per_s"] for r in serial_runs) if serial_runs else None
    table = Table(
        title=f"{args.workload}: {args.batches} batches of {args.batch_size}, {cores} cores, "
        f"medians (min-max) of {args.repeats} fresh processes; load average {load:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end"
    )
    for column in ("way", "samples/s", "x serial", "first batch ms", "memory added MiB"):
        table.add_column(column, justify="left" if column == "way" else "right")
    for (way, count), runs in results.items():
        cells = []
        for key, scale, spec in (
            ("samples_per_s", 1, ",.0f"),
            ("first_s", 1e3, ".0f"),
            ("added_mib", 1, ".0f"),
        ):
            values = [r[key] * scale for r in runs]
            cells.append(
                f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"
            )
        speed = statistics.median(r["samples_per_s"] for r in runs) / serial if serial else None
        name = {"serial": "DataLoader serial", "workers": f"DataLoader num_workers={count}"}.get(
            way, f"{way} {count} thread{'s' if count > 1 else ''}"
        )
        table.add_row(name, cells[0], "-" if speed is None else f"{speed:.2f}", cells[1], cells[2])
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
