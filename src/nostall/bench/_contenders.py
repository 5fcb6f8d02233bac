"""The registry of ways to feed a training loop that the bench runs side by side.

``make(sources, device, depth)`` returns a re-iterable of device batches, an epoch per
``iter()``; ``sources.workers`` is the best-practice ``DataLoader`` (workers, ``pin_memory`` on
CUDA, persistent). Peers are imported lazily, skipped when missing (the ``peers`` extra).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from .._prefetcher import prefetch
from ..cuda._transfer import to_device


class Sources(NamedTuple):
    """The two host-side loaders over the same dataset."""

    serial: Iterable[Any]
    workers: Iterable[Any]


@dataclass(frozen=True)
class Contender:
    """One way of feeding the loop; ``prefetcher`` ones also run the hand-off trial."""

    name: str
    make: Callable[[Sources, torch.device, int], Iterable[Any]]
    requires: str | None = None  # a peer's module
    cuda_only: bool = False
    prefetcher: bool = False
    requires_on_cuda: str | None = None  # a module it needs on CUDA only

    def available(self, device: torch.device) -> bool:
        """Whether this contender can run here."""
        if self.cuda_only and device.type != "cuda":
            return False
        needed = self.requires_on_cuda if device.type == "cuda" else None
        return all(
            m is None or importlib.util.find_spec(m) is not None for m in (self.requires, needed)
        )


class Reiterable:
    """An iterable that calls ``start()`` for each epoch."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start()


def moved(batches: Iterable[Any], device: torch.device, non_blocking: bool) -> Reiterable:
    """``batches`` moved to ``device`` in the consuming thread, as a plain loop does it."""
    return Reiterable(lambda: (to_device(b, device, non_blocking=non_blocking) for b in batches))


def _seed(sources: Sources, device: torch.device, depth: int) -> Reiterable:
    """The seed documents' design: a thread filling a ``Queue(2)`` (unsafe on CUDA).

    It copies on a side stream with ``non_blocking=True`` and the consumer never waits for the
    copy. The original loops forever and leaks its thread; this one ends with each epoch.
    """
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def epoch() -> Iterator[Any]:
        items: queue.Queue[Any] = queue.Queue(2)

        def run() -> None:
            for batch in sources.serial:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        batch = to_device(batch, device, non_blocking=True)
                items.put(batch)
            items.put(items)  # the queue itself marks the end

        threading.Thread(target=run, name="bench-seed-prefetcher", daemon=True).start()
        while (batch := items.get()) is not items:
            yield batch

    return Reiterable(epoch)


def _lookahead(sources: Sources, device: torch.device, depth: int) -> Reiterable:
    """timm's ``PrefetchLoader`` style: copy batch k+1 on a side stream while k is used."""
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def epoch() -> Iterator[Any]:
        current: Any = None
        for i, upcoming in enumerate(sources.workers):
            with torch.cuda.stream(stream):
                upcoming = to_device(upcoming, device, non_blocking=True)
            if i:
                yield current
            torch.cuda.current_stream(device).wait_stream(stream)
            current = upcoming
        if current is not None:
            yield current

    return Reiterable(epoch)


def _prefetch_generator(sources: Sources, device: torch.device, depth: int) -> Reiterable:
    from prefetch_generator import BackgroundGenerator

    # Its default depth (max_prefetch=1); the consumer moves each batch, as its users do.
    return Reiterable(lambda: (to_device(b, device) for b in BackgroundGenerator(sources.serial)))


def _torchdata_nodes(sources: Sources, device: torch.device, depth: int) -> Reiterable:
    import torchdata.nodes as tn

    node: Any = tn.IterableWrapper(sources.serial)
    cuda = device.type == "cuda"
    loader = tn.Loader(tn.Prefetcher(tn.PinMemory(node) if cuda else node, prefetch_factor=2))
    return moved(loader, device, cuda)  # torchdata.nodes has no device transfer


def _decode_on_device(sources: Sources, device: torch.device, depth: int) -> Any:
    """The JPEGs' bytes batched, decoded and augmented where the batch goes (nvJPEG on CUDA).

    Over the files of the trial's dataset (a ``JpegImages``, read through the serial loader's
    ``dataset``): the loader reads bytes, ``DecodeJPEG`` decodes on the copy stream, then the
    crops (35-100% of the area, as the workload's) and flips of ``nostall.transforms``.
    """
    from .. import transforms as T

    images = sources.serial.dataset  # type: ignore[attr-defined]
    count, size = len(images.paths), images.size
    files = T.ImageBytes([(images.paths[i % count], i % 10) for i in range(len(images))])
    batch_size = sources.serial.batch_size  # type: ignore[attr-defined]
    loader = DataLoader(files, batch_size=batch_size, collate_fn=T.collate_encoded)
    pipeline = T.Compose(
        [
            T.DecodeJPEG(),
            T.RandomResizedCrop(size, scale=(0.35, 1.0), antialias=True),
            T.RandomHorizontalFlip(),
        ]
    )
    return prefetch(loader, device, depth=depth, transform=pipeline)


SERIAL = Contender("serial DataLoader", lambda s, d, _: moved(s.serial, d, False))
BEST = Contender("best-practice DataLoader", lambda s, d, _: moved(s.workers, d, d.type == "cuda"))
SEED = Contender("seed thread+Queue(2)", _seed, prefetcher=True)  # unsafe on CUDA
PREFETCH_GENERATOR = Contender(
    "prefetch_generator", _prefetch_generator, "prefetch_generator", prefetcher=True
)
TORCHDATA = Contender("torchdata.nodes", _torchdata_nodes, "torchdata", prefetcher=True)
LOOKAHEAD = Contender("timm-style lookahead", _lookahead, cuda_only=True)
NOSTALL = Contender("nostall", lambda s, d, n: prefetch(s.serial, d, depth=n), prefetcher=True)
NOSTALL_WORKERS = Contender("nostall + workers", lambda s, d, n: prefetch(s.workers, d, depth=n))
#: JPEG trials only: it reads the files of the trial's ``JpegImages``.
DECODE = Contender("nostall DecodeJPEG", _decode_on_device, requires_on_cuda="torchvision")


def usable_cores() -> int:
    """The cores this process may run on (its affinity; a container's share), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


#: Loading threads: one per usable core, less one for the training thread where there are
#: more than four (with all of them, loading and the step's launches fight for the cores).
THREADS = usable_cores() - 1 if usable_cores() > 4 else usable_cores()
NOSTALL_THREADS = Contender(
    f"nostall threads={THREADS}", lambda s, d, n: prefetch(s.serial, d, depth=n, threads=THREADS)
)
# Twice the cores: where the step waits for the device, loading has every core, and threads
# blocked in I/O or between GIL-free calls leave room for more.
NOSTALL_THREADS_2X = Contender(
    f"nostall threads={2 * THREADS}",
    lambda s, d, n: prefetch(s.serial, d, depth=n, threads=2 * THREADS),
)

#: Every contender, in the order tables list them.
ALL: tuple[Contender, ...] = (SERIAL, BEST, SEED, PREFETCH_GENERATOR, TORCHDATA, LOOKAHEAD)
ALL += (NOSTALL, NOSTALL_WORKERS, NOSTALL_THREADS, NOSTALL_THREADS_2X, DECODE)
#: The contenders of the CPU-step trials: all but the doubled threads, which there take the
#: step's own cores, and the decode on the device, which runs in the augmented JPEG trial.
CPU_STEP = tuple(k for k in ALL if k not in (NOSTALL_THREADS_2X, DECODE))
#: The GPU-regime trial's (the step waits for the device): the loaders a GPU user picks from.
GPU_REGIME: tuple[Contender, ...] = (SERIAL, BEST, PREFETCH_GENERATOR, TORCHDATA, NOSTALL)
GPU_REGIME += (NOSTALL_WORKERS, NOSTALL_THREADS, NOSTALL_THREADS_2X)


def chosen(
    names: tuple[str, ...], device: torch.device, among: tuple[Contender, ...] = CPU_STEP
) -> list[Contender]:
    """The contenders ``among`` that run: those named (all when none are), that can run here."""
    return [k for k in among if (not names or k.name in names) and k.available(device)]
