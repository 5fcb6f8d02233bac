"""The ways of feeding a training loop that the benchmark runs side by side.

Each contender turns a source of host batches into a re-iterable of device batches, one epoch
per ``iter()``. Peers are imported lazily and skipped when they are not installed (the ``peers``
extra installs them). The seed design and the lookahead prefetcher are written here, in the
peers' style, for comparison only.
"""

from __future__ import annotations

import importlib.util
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._prefetcher import prefetch
from .._transfer import to_device


@dataclass(frozen=True)
class Sources:
    """The two host-side sources every contender draws from.

    ``serial`` loads in the calling thread (a ``DataLoader`` with ``num_workers=0``);
    ``workers`` is the best-practice ``DataLoader`` (worker processes, ``pin_memory`` on CUDA,
    ``persistent_workers=True``).
    """

    serial: Iterable[Any]
    workers: Iterable[Any]


Make = Callable[[Sources, torch.device, int], Iterable[Any]]


@dataclass(frozen=True)
class Contender:
    """One way of feeding the loop.

    Attributes:
        name: shown in tables.
        source: which of :class:`Sources` it reads (``"serial"`` or ``"workers"``); that
            source's load-only time bounds its epoch.
        make: builds the re-iterable of device batches, given the sources, the device and a
            prefetch depth (used by contenders that have one).
        requires: a module that must be importable, for peers.
        cuda_only: only meaningful with a GPU.
        unsafe: reads batches without waiting for their copy (the seed design).
        prefetcher: fetches ahead in the background (these also run the hand-off test).
    """

    name: str
    source: str
    make: Make
    requires: str | None = None
    cuda_only: bool = False
    unsafe: bool = False
    prefetcher: bool = False

    def available(self, device: torch.device) -> bool:
        """Whether this contender can run here."""
        if self.cuda_only and device.type != "cuda":
            return False
        return self.requires is None or importlib.util.find_spec(self.requires) is not None


class _Reiterable:
    """An iterable that calls ``start()`` for each epoch."""

    def __init__(self, start: Callable[[], Iterator[Any]]) -> None:
        self._start = start

    def __iter__(self) -> Iterator[Any]:
        return self._start()


def _moved(batches: Iterable[Any], device: torch.device, non_blocking: bool) -> Iterator[Any]:
    for batch in batches:
        yield to_device(batch, device, non_blocking=non_blocking)


def _serial(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    return _Reiterable(lambda: _moved(sources.serial, device, False))


def _best_practice(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    return _Reiterable(lambda: _moved(sources.workers, device, device.type == "cuda"))


class SeedPrefetcher:
    """The seed documents' design, a thread filling a ``Queue(2)``.

    On CUDA it copies batches on a side stream with ``non_blocking=True`` and the consumer never
    waits for the copy (unsafe). Written per epoch here (the original loops forever and leaks
    its thread), so that it can be timed fairly.
    """

    def __init__(self, source: Iterable[Any], device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def __iter__(self) -> Iterator[Any]:
        items: queue.Queue[Any] = queue.Queue(2)
        end = object()

        def run() -> None:
            if self.stream is not None:
                torch.cuda.set_device(self.device)
            for batch in self.source:
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        batch = to_device(batch, self.device, non_blocking=True)
                items.put(batch)
            items.put(end)

        threading.Thread(target=run, name="bench-seed-prefetcher", daemon=True).start()
        while (batch := items.get()) is not end:
            yield batch


class LookaheadPrefetcher:
    """A one-batch lookahead on a side stream in the consumer thread, in the style of timm's.

    Like timm's ``PrefetchLoader``: copy batch k+1 while batch k is used; ``wait_stream``
    before use.
    """

    def __init__(self, source: Iterable[Any], device: torch.device) -> None:
        self.source, self.device = source, device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def __iter__(self) -> Iterator[Any]:
        current: Any = None
        first = True
        for upcoming in self.source:
            with torch.cuda.stream(self.stream):
                upcoming = to_device(upcoming, self.device, non_blocking=True)
            if not first:
                yield current
            first = False
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            current = upcoming
        if not first:
            yield current


class ForeverSeedPrefetcher:
    """The seed design as written there: one thread loops over the loader forever.

    Epochs are cut from the endless stream by the loader's length, so the next epoch starts at
    once (and before ``set_epoch`` can reach the sampler: the seed's defect). ``close()`` stops
    the thread; this exists to measure epoch boundaries.
    """

    def __init__(self, source: Any, device: torch.device) -> None:
        self.source, self.device = source, device
        self.items: queue.Queue[Any] = queue.Queue(2)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-seed-forever", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            for batch in self.source:
                moved = to_device(batch, self.device)
                while not self.stopped.is_set():
                    try:
                        self.items.put(moved, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self.stopped.is_set():
                    return

    def __iter__(self) -> Iterator[Any]:
        for _ in range(len(self.source)):
            yield self.items.get()

    def close(self) -> None:
        """Stop the endless thread."""
        self.stopped.set()
        self.thread.join(5)


def _seed(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    return SeedPrefetcher(sources.serial, device)


def _lookahead(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    return LookaheadPrefetcher(sources.workers, device)


def _prefetch_generator(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    from prefetch_generator import BackgroundGenerator  # the peers extra

    # Its default depth (max_prefetch=1); batches are moved in the consumer, as its users do.
    return _Reiterable(lambda: _moved(BackgroundGenerator(iter(sources.serial)), device, False))


def _torchdata_nodes(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
    import torchdata.nodes as tn  # the peers extra

    node: Any = tn.IterableWrapper(sources.serial)
    cuda = device.type == "cuda"
    if cuda:
        node = tn.PinMemory(node)
    loader = tn.Loader(tn.Prefetcher(node, prefetch_factor=2))
    # torchdata.nodes has no device transfer: the consumer moves each batch.
    return _Reiterable(lambda: _moved(loader, device, cuda))


def _nostall_over(source_name: str) -> Make:
    def make(sources: Sources, device: torch.device, depth: int) -> Iterable[Any]:
        return prefetch(getattr(sources, source_name), device, depth=depth)

    return make


SERIAL = Contender("serial DataLoader", "serial", _serial)
BEST_PRACTICE = Contender("best-practice DataLoader", "workers", _best_practice)
SEED = Contender("seed thread+Queue(2)", "serial", _seed, unsafe=True, prefetcher=True)
PREFETCH_GENERATOR = Contender(
    "prefetch_generator",
    "serial",
    _prefetch_generator,
    requires="prefetch_generator",
    prefetcher=True,
)
TORCHDATA = Contender(
    "torchdata.nodes", "serial", _torchdata_nodes, requires="torchdata", prefetcher=True
)
LOOKAHEAD = Contender("timm-style lookahead", "workers", _lookahead, cuda_only=True)
NOSTALL = Contender("nostall", "serial", _nostall_over("serial"), prefetcher=True)
NOSTALL_WORKERS = Contender("nostall + workers", "workers", _nostall_over("workers"))

#: Every contender, in the order tables list them.
ALL = (
    SERIAL,
    BEST_PRACTICE,
    SEED,
    PREFETCH_GENERATOR,
    TORCHDATA,
    LOOKAHEAD,
    NOSTALL,
    NOSTALL_WORKERS,
)


def with_depth(contender: Contender, depth: int) -> Contender:
    """A nostall contender at a given depth, named after it (for the depth sweep)."""
    return Contender(
        f"{contender.name} (depth {depth})",
        contender.source,
        lambda sources, device, _: contender.make(sources, device, depth),
        contender.requires,
        contender.cuda_only,
        contender.unsafe,
        contender.prefetcher,
    )
