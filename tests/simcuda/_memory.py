"""A model of PyTorch's CUDA caching allocator that remembers who used each byte range.

It allocates as ``c10/cuda/CUDACachingAllocator.cpp`` does:

* sizes are rounded up to a multiple of 512 bytes (at least 512);
* requests of at most 1 MiB come from a small pool, larger ones from a large pool;
* a request takes the smallest free block of its pool that fits (best fit: any larger free
  block, not only one of its size), on its device and stream, lowest address first on ties;
* a block larger than the request is split and the remainder goes back to the pool (small
  pool: a remainder of at least 512 bytes; large pool: of more than 1 MiB);
* when nothing fits, a new segment is reserved: 2 MiB for small requests, 20 MiB for
  requests under 10 MiB, else the request rounded up to 2 MiB;
* a freed block merges with free neighbours of its segment;
* ``empty_cache`` gives back segments with nothing allocated or waiting.

Invariants:
    * A segment belongs to the stream it was reserved for, and its blocks are only ever
      handed to allocations on that stream (one pool per stream), as in PyTorch.
    * A freed block returns to its pool at once, unless ``record_stream`` added other streams:
      then it waits until the host has seen each of those streams pass the point of the free
      (PyTorch records an event on each and polls it; in this model an event is done only
      once the host knows it is, see :mod:`simcuda._simulation`).
    * The access history of memory survives reuse, by byte range. Each allocation is a
      tenancy of a range of its segment; a tenancy that ended stays in the segment's history
      until the host has seen all its accesses finish (or a later tenant's ordered write
      covered it), and a new tenant's accesses are checked against the earlier tenancies it
      overlaps: that is how a missing ``record_stream`` shows, also when a smaller tensor
      lands in part of a larger one's memory.
    * Freed storage is found by polling weak references at the next allocation (no finalizers,
      so nothing runs inside the garbage collector): a free is noticed late, never early, which
      can only delay reuse, never invent a hazard.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef


def weak_ref(storage: Any) -> StorageWeakRef:
    """A weak reference to ``storage`` that does not keep it alive (unannotated in torch)."""
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def expired(ref: StorageWeakRef) -> bool:
    """Whether the storage ``ref`` refers to was freed."""
    return bool(ref.expired())  # type: ignore[no-untyped-call]


#: Every size is rounded up to a multiple of this (PyTorch's ``kMinBlockSize``).
MIN_BLOCK = 512
#: Requests up to this size come from the small pool (``kSmallSize``).
SMALL_SIZE = 2**20
#: The segment reserved for small requests (``kSmallBuffer``).
SMALL_BUFFER = 2 * 2**20
#: The segment reserved for large requests under ``MIN_LARGE_ALLOC`` (``kLargeBuffer``).
LARGE_BUFFER = 20 * 2**20
#: From this size a request gets a segment of its own size (``kMinLargeAlloc``) ...
MIN_LARGE_ALLOC = 10 * 2**20
#: ... rounded up to a multiple of this (``kRoundLarge``).
ROUND_LARGE = 2 * 2**20


def round_size(nbytes: int) -> int:
    """The size a request of ``nbytes`` is served with."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment reserved when no free block fits a (rounded) request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class Access:
    """One kernel's use of a tenancy's memory."""

    stream: int
    seq: int
    tenant: int
    op: str
    where: str


@dataclass(eq=False)
class Tenancy:
    """One allocation's use of a byte range of a segment, and its accesses."""

    tenant: int
    start: int
    end: int
    last_write: Access | None = None
    #: The latest read per stream since ``last_write``.
    reads: dict[int, Access] = field(default_factory=dict)
    #: Whether a write ordered after the earlier tenancies it overlaps has happened (from
    #: then on, stream order covers them).
    settled: bool = False

    def accesses(self) -> list[Access]:
        return ([self.last_write] if self.last_write else []) + list(self.reads.values())

    def overlaps(self, other: Tenancy) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass(eq=False)
class Segment:
    """Memory reserved from the "driver" for one stream's pool on one device."""

    id: int
    device: int
    stream: int
    size: int
    small: bool
    #: The blocks that tile the segment, by address.
    blocks: list[Block] = field(default_factory=list)
    #: Tenancies that ended whose accesses may still matter to the next tenants.
    history: list[Tenancy] = field(default_factory=list)


@dataclass(eq=False)
class Block:
    """A piece of a segment: allocated to one tensor's storage, free in its pool, or waiting."""

    segment: Segment
    offset: int
    size: int
    allocated: bool = False
    #: Freed but waiting for the streams ``record_stream`` named.
    waiting: bool = False
    tenancy: Tenancy | None = None
    #: Streams other than ``stream`` named by ``record_stream`` during the current tenancy.
    recorded: set[int] = field(default_factory=set)

    @property
    def device(self) -> int:
        return self.segment.device

    @property
    def stream(self) -> int:
        return self.segment.stream

    @property
    def id(self) -> str:
        """Where the block is: segment and offset (what an address says on a GPU)."""
        return f"{self.segment.id}+{self.offset}"

    @property
    def tenant(self) -> int:
        return 0 if self.tenancy is None else self.tenancy.tenant


class Allocator:
    """Segments by stream, free blocks by pool, live blocks by storage, and waiting blocks."""

    def __init__(self) -> None:
        self._segment_ids = itertools.count()
        self._tenants = itertools.count(1)
        #: Live storages (keyed by the storage's C pointer, kept unique by the weak reference).
        self.live: dict[int, tuple[StorageWeakRef, Block]] = {}
        self.segments: list[Segment] = []
        #: Free blocks per (device, stream, small pool).
        self.pools: dict[tuple[int, int, bool], list[Block]] = {}
        self.pending: list[tuple[Block, dict[int, int]]] = []
        self.peak: dict[int, int] = {}

    def block_of(self, tensor: torch.Tensor) -> Block | None:
        """The block holding ``tensor``'s (CPU stand-in) storage, if it is device memory."""
        entry = self.live.get(tensor.untyped_storage()._cdata)
        return None if entry is None or expired(entry[0]) else entry[1]

    def allocate(
        self, storage: Any, device: int, stream: int, known: dict[int, dict[int, int]], host: Any
    ) -> Block:
        """Give ``storage`` a block from ``stream``'s pool: best fit, split, or a new segment."""
        self.sweep(known, host)
        size = round_size(storage.nbytes())
        small = size <= SMALL_SIZE
        pool = self.pools.setdefault((device, stream, small), [])
        fits = [b for b in pool if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.segment.id, b.offset))
            pool.remove(block)
        else:
            total = segment_size(size)
            segment = Segment(next(self._segment_ids), device, stream, total, small)
            block = Block(segment, 0, total)
            segment.blocks.append(block)
            self.segments.append(segment)
        self._split(block, size, pool)
        block.allocated = True
        block.tenancy = Tenancy(next(self._tenants), block.offset, block.offset + block.size)
        self.live[storage._cdata] = (weak_ref(storage), block)
        self.peak[device] = max(self.peak.get(device, 0), self.allocated(device))
        return block

    @staticmethod
    def _split(block: Block, size: int, pool: list[Block]) -> None:
        """Cut ``block`` to ``size`` when the remainder is worth keeping, as PyTorch does."""
        remaining = block.size - size
        if remaining >= MIN_BLOCK if block.segment.small else remaining > SMALL_SIZE:
            rest = Block(block.segment, block.offset + size, remaining)
            blocks = block.segment.blocks
            blocks.insert(blocks.index(block) + 1, rest)
            block.size = size
            pool.append(rest)

    def sweep(self, known: dict[int, dict[int, int]], host: dict[int, int]) -> None:
        """Free blocks whose storage died; release waiting blocks the host has seen pass."""
        for key, (ref, block) in list(self.live.items()):
            if expired(ref):
                del self.live[key]
                block.allocated = False
                if block.recorded:
                    need = {s: known.get(s, {}).get(s, 0) for s in block.recorded}
                    block.waiting, block.recorded = True, set()
                    self.pending.append((block, need))
                else:
                    self._release(block)
        still = []
        for block, need in self.pending:
            if all(host.get(s, 0) >= seq for s, seq in need.items()):
                block.waiting = False
                self._release(block)
            else:
                still.append((block, need))
        self.pending = still
        for segment in self.segments:
            segment.history = [
                t
                for t in segment.history
                if any(host.get(a.stream, 0) < a.seq for a in t.accesses())
            ]

    def _release(self, block: Block) -> None:
        """Back to its pool, merged with free neighbours; its tenancy becomes history."""
        segment = block.segment
        if block.tenancy is not None:
            segment.history.append(block.tenancy)
            block.tenancy = None
        pool = self.pools.setdefault((segment.device, segment.stream, segment.small), [])
        blocks = segment.blocks
        i = blocks.index(block)
        for j in (i + 1, i - 1):  # the next first, so that i stays valid for the previous
            if 0 <= j < len(blocks) and self._is_free(blocks[j], pool):
                other = blocks[j]
                pool.remove(other)
                block.offset, block.size = min(block.offset, other.offset), block.size + other.size
                blocks.remove(other)
        pool.append(block)

    @staticmethod
    def _is_free(block: Block, pool: list[Block]) -> bool:
        return not block.allocated and not block.waiting and block in pool

    def earlier_tenancies(self, block: Block) -> list[Tenancy]:
        """The ended tenancies of ``block``'s segment that overlap its current one."""
        current = block.tenancy
        if current is None:
            return []
        return [t for t in block.segment.history if t.overlaps(current)]

    def settle(self, block: Block) -> None:
        """``block``'s tenant wrote, ordered after the earlier tenancies it overlaps.

        Those it covers entirely can be forgotten: any later access ordered after this write
        is ordered after them too.
        """
        current = block.tenancy
        if current is None or current.settled:
            return
        current.settled = True
        block.segment.history = [
            t
            for t in block.segment.history
            if not (current.start <= t.start and t.end <= current.end)
        ]

    def allocated(self, device: int) -> int:
        """Bytes held by live tensors on ``device`` (their blocks' sizes)."""
        return sum(b.size for r, b in self.live.values() if b.device == device and not expired(r))

    def reserved(self, device: int) -> int:
        """Bytes of the segments the allocator holds on ``device``."""
        return sum(s.size for s in self.segments if s.device == device)

    def empty_cache(self, known: dict[int, dict[int, int]], host: dict[int, int]) -> None:
        """Give back every segment with nothing allocated or waiting (and forget its history)."""
        self.sweep(known, host)
        kept = []
        for segment in self.segments:
            if any(b.allocated or b.waiting for b in segment.blocks):
                kept.append(segment)
                continue
            pool = self.pools[(segment.device, segment.stream, segment.small)]
            for b in segment.blocks:
                pool.remove(b)
        self.segments = kept
