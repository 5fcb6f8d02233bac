"""The side streams prefetchers copy on: lent one per live staging, taken back when it dies.

PyTorch's caching allocator keeps the blocks freed on a stream in that stream's own pool, for
that stream only, and ``torch.cuda.Stream()`` hands out a different stream of a 32-stream pool
each time. A prefetcher made per epoch (``for b in nostall.prefetch(loader)`` inside the
epoch loop) therefore left its cached blocks behind in one pool after another: reserved memory
grew by the batches' size every epoch, up to 32 times (6, 8, 10, 12, 14, 16 MiB over 6 epochs
of 1 MiB batches on an H100, against 6 MiB flat with one prefetcher reused).
"""

from __future__ import annotations

import threading
import weakref

import torch


class CopyStreams:
    """Copy streams lent to stagings, one each, and lent again once their staging is gone.

    Invariants:
        * A stream is lent to at most one live staging at a time: two prefetchers alive
          together (training and validation) never order each other's copies.
        * A stream taken back is lent again before a new one is made, on its device, so the
          blocks cached in its pool are reused: reserved memory stays flat however often
          prefetchers are made, bounded by how many are alive at once.
        * A stream is taken back only when its staging has been garbage collected: nothing can
          queue work on it any more through that staging. Work already queued stays ordered
          before whatever the next borrower queues (stream order), and memory recorded for
          other streams stays protected by the allocator.
    """

    def __init__(self) -> None:
        # Reentrant: a take-back run by reference counting may hold it when the garbage
        # collector finalises another staging in the same thread (a plain lock deadlocked).
        self._lock = threading.RLock()
        self._free: dict[int, list[torch.cuda.Stream]] = {}

    def lend(self, device: torch.device, borrower: object) -> torch.cuda.Stream:
        """A copy stream on ``device`` for ``borrower``, taken back when it is collected."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            free = self._free.get(index)
            stream = free.pop() if free else None
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        weakref.finalize(borrower, self._take_back, index, stream)
        return stream

    def _take_back(self, index: int, stream: torch.cuda.Stream) -> None:
        with self._lock:
            self._free.setdefault(index, []).append(stream)

    def free_count(self, device_index: int) -> int:
        """How many streams on ``device_index`` wait to be lent again."""
        with self._lock:
            return len(self._free.get(device_index, ()))


#: The process's copy streams (the simulated CUDA of the tests swaps in its own).
LENDER = CopyStreams()
