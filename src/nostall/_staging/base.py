"""Staging without streams: the Staged batch and the steps every device shares.

A batch goes through staging between the source and the consumer::

    copy -> transform (and its checkpoint)

:class:`Staging` runs them in the producer thread (the CPU, XPU, ...: devices that need no
stream handling); :class:`ConsumerThreadStaging` runs them at hand-out, in the consumer's
thread (MPS). CUDA adds pinning, a copy stream and a ready event
(:mod:`nostall._staging.cuda`); :func:`nostall._staging.choose.staging_for` picks one per device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .._transform_state import stateful
from ..cuda._transfer import call_to
from ..cuda._tree import map_tensors

#: A warning found while staging a batch: its key (once per process) and its message.
DueWarning = tuple[tuple[str, type], str]


class Staged(NamedTuple):
    """A batch moved by the producer, not yet handed to the consumer."""

    batch: Any
    #: Recorded on the copy stream after the batch's copies were queued; ``None`` off CUDA.
    ready: torch.cuda.Event | None
    #: The CUDA tensors to mark as used by the consumer's stream (``record_stream``).
    tensors: list[torch.Tensor]
    #: The transform's ``state_dict()`` right after this batch, when it has one: what a
    #: checkpoint taken after handing this batch out must hold.
    transform_state: Any = None
    #: Warnings about this batch's objects, raised when it is handed out
    #: (:func:`nostall._staging.cuda._warn_due`).
    due: tuple[DueWarning, ...] = ()


class Staging:
    """Moves batches to a device that needs no stream handling (the CPU, XPU, ...).

    Steps: copy (tensors not on the device yet) -> transform -> no ready event (the consumer's
    own thread reads the batch after it was made). ``check_consumer`` and ``hand_out`` run in
    the consumer thread.
    """

    #: True where the batch is moved and transformed in the consumer's thread, at hand-out
    #: (:class:`ConsumerThreadStaging`); the producer then only fetches it.
    late = False
    #: True where :meth:`source_context` has nothing to set: the source is called bare.
    plain_source = True

    def __init__(self, device: torch.device, transform: Callable[[Any], Any] | None = None) -> None:
        """Stage batches to ``device``, transformed by ``transform`` when there is one.

        Raises:
            TypeError: ``transform`` has half of the state contract (``state_dict()`` without
                ``load_state_dict()``, or the reverse), at ``prefetch(...)``.
        """
        self.device = device
        #: Applied to each moved batch (``nostall.transforms``); on CUDA, on the copy stream.
        self.transform = transform
        #: The transform when it keeps the state contract, decided once, here (a transform
        #: with half of it is refused: see :func:`nostall._transform_state.stateful`).
        self._stateful = stateful(transform)
        #: A batch that is a tuple of plain CPU tensors is staged as it is (nothing to move).
        self._cpu_as_is = device.type == "cpu" and transform is None

    def transform_state(self) -> Any:
        """The transform's state now (``None`` unless it is a ``StatefulTransform``)."""
        return None if self._stateful is None else self._stateful.state_dict()

    def load_transform_state(self, state: Any) -> None:
        """Give a ``StatefulTransform`` the state a checkpoint saved (nothing without one)."""
        if self._stateful is not None:
            self._stateful.load_state_dict(state)

    def before_epoch(self) -> None:
        """Called where an epoch's iterator is made, before it is (nothing off CUDA)."""

    def source_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around every call into the source, in whichever thread makes it.

        The producer's pulls, the consumer's own pulls and the loading threads (``threads=``)
        all run the source inside it. Off CUDA there is nothing to set.
        """
        return contextlib.nullcontext()

    def pull_context(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around a batch the consumer pulls itself (source and staging together).

        Where a device has stream state to set per pull, this lets it read the thread's once
        per pull (see ``CudaStaging``); off CUDA there is nothing to read.
        """
        return contextlib.nullcontext()

    def start_thread(self) -> None:
        """Prepare the producer thread; called once in it before the first batch.

        Torch ops run by the source in this thread get one intra-op thread (a thread-local
        setting, as in PyTorch's own pin-memory thread and DataLoader workers): with more, each
        calling thread brings its own OpenMP team whose spinning threads take the cores the
        model's step needs (measured: a prefetched CPU epoch ran slower than the serial one).
        """
        torch.set_num_threads(1)

    def stage(self, batch: Any) -> Staged:
        """Copy ``batch`` to the device, then transform it (producer thread)."""
        if self._cpu_as_is and type(batch) is tuple:
            # The common CPU batch, without a walk: a tuple is immutable, so handing out the
            # same one is handing out an equal copy (the rebuilt tuple the walk would make).
            for t in batch:
                if type(t) is not torch.Tensor or not t.is_cpu:
                    break
            else:
                # Staged(...) made by tuple's C constructor: no Python frame per batch.
                return tuple.__new__(Staged, (batch, None, [], None, ()))
        device = self.device
        moved = map_tensors(
            batch,
            lambda t: t if t.device == device else t.to(device),
            lambda obj: call_to(obj, device, False),
        )
        if self.transform is None:
            return Staged(moved, None, [], None)  # no transform: no step, no state
        moved, transform_state = self._transform_step(moved)
        return Staged(moved, None, [], transform_state)

    def _transform_step(self, moved: Any) -> tuple[Any, Any]:
        """Transform the moved batch; return it with the transform's checkpoint right after it.

        The checkpoint is taken here, with the batch, so that a state saved after handing this
        batch out holds the transform's state as it was then, not as batches fetched ahead
        left it.
        """
        if self.transform is not None:
            moved = self.transform(moved)
        return moved, self.transform_state()

    def check_consumer(self) -> None:
        """Raise if the calling thread cannot take a batch now (before anything is taken)."""

    def hand_out(self, staged: Staged) -> Any:
        """Return the batch, ready for use by the calling thread (consumer thread)."""
        return staged.batch


class ConsumerThreadStaging(Staging):
    """Fetches in the producer thread; moves and transforms in the consumer's thread (MPS).

    On MPS, device work issued from a second thread runs concurrently with the model's own,
    which aborts inside Metal on affected versions (pytorch/pytorch#197805): the producer
    thread fetches and collates the batch ahead, on the host, and the copy to the device and
    the transform run where the model runs, when the batch is handed out. The transform's
    checkpoint is read right after it, there.
    """

    late = True

    def stage(self, batch: Any) -> Staged:
        """Nothing to do in the producer thread: the batch stays on the host."""
        return Staged(batch, None, [], None)

    def hand_out(self, staged: Staged) -> Any:
        """Copy the batch to the device and transform it, in the consumer's thread."""
        return Staging.stage(self, staged.batch).batch
