"""Staging on CUDA: pin -> copy on a side stream -> transform -> ready event.

:meth:`CudaStaging.stage` runs in the producer thread (or the consumer's, when it pulls a batch
itself); :meth:`CudaStaging.hand_out` runs in the consumer thread: its current stream waits for
the ready event and the batch's memory is kept for it (``record_stream``), and the warnings
staging found about the batch (objects that cannot pin, tensors hidden from nostall) are
raised there, at the user's line (the producer thread has none).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._warn import warn
from ..cuda._transfer import call_pin_memory, call_to, compact, record_stream
from ..cuda._tree import UNHANDLED, iter_tensors, map_tensors
from . import copy_streams as _copy_streams
from .base import DueWarning, Staged, Staging


class CudaStaging(Staging):
    """Pins and copies batches on one side stream; the consumer's stream waits for each batch.

    Steps, all queued on the copy stream: pin -> copy (leaf by leaf, so a leaf's copy runs
    while the next one is pinned) -> transform -> ready event.

    Invariants:
        * The source runs on the target device and on a source stream of its own, borrowed
          like the copy stream, in every thread that calls it (:meth:`source_context`: the
          producer, the consumer pulling a batch itself, the loading threads). GPU work the
          source does (decoding on the GPU, collating device tensors) is so ordered before
          the copy stream, which waits for the source stream, and never on another device.
        * One copy stream per instance, borrowed here and never replaced (streams per epoch would
          grow reserved memory), and lent to the next staging once this one is collected
          (:mod:`nostall._staging.copy_streams`): prefetchers made one after another share its pool.
        * A batch is handed out only after the consumer's current stream waits on the event
          recorded after its copies and transforms, so no kernel can read it early. When the
          source put tensors on the device, the copy stream first waits for the stream they
          were written on (the staging thread's current stream); otherwise it waits for
          nothing, so copies never queue behind the model's work.
        * Every CUDA tensor of a handed-out batch is ``record_stream``-ed on the consumer's
          stream, and device inputs a transform reads on the copy stream are ``record_stream``-ed
          there, so the caching allocator never reuses memory another stream may still read.
        * An object whose ``.to()`` returns one marked ``read_on_host = True`` (encoded images:
          GPU decoders read their bytes in host memory) stays on the host, pinned; it holds
          no device memory to protect.
        * ``non_blocking=True`` is used only from pinned memory, where it is truly asynchronous.
        * Nothing in staging makes the host wait for the device (no ``.item()``, no blocking
          or pageable copies) unless the user turned pinning off or a batch object cannot pin.
        * No batch is handed out while the consumer's stream captures a CUDA graph.
        * A small common batch the consumer pulls itself (at most ``HERE_BYTES``: a tuple or
          list of host tensors, no transform, pinning on: a pageable copy on the consumer's
          stream would wait for its queued kernels) is copied on the consumer's own current stream,
          as a plain ``.to()`` loop copies it: in stream order before the consumer's next
          kernels and allocated on that stream, so it needs no event, no wait and no
          ``record_stream``, which cost more host time than such a copy takes on the GPU. It
          is handed out in the same ``next()``, on that same stream (``_Pulling``).
        * Per batch, nostall asks torch for no stream and no device where it knows them: in
          the producer thread (always) and in the consumer while it pulls a batch itself,
          the target device is current and so is a known resting stream, so the source and
          copy streams are set and the resting one set back directly (``_Use``), with what
          ``torch.cuda.device``/``torch.cuda.stream`` would leave current before and after.
    """

    plain_source = False  # the source runs on the target device and the source stream

    #: The largest common batch, in bytes, that the consumer copies on its own stream when it
    #: pulls the batch itself. A side stream costs the host an event, a wait and a
    #: ``record_stream`` per batch (about 15 us on an H200's host); a copy of 256 KiB takes
    #: about 5 us of the GPU at 54 GB/s, so for a batch this small the GPU loses less by
    #: running the copy in line with the model's kernels than the host gains.
    HERE_BYTES = 256 * 1024

    def __init__(
        self, device: torch.device, pin: bool, transform: Callable[[Any], Any] | None = None
    ) -> None:
        super().__init__(device, transform)
        self.pin = pin
        #: The target's index, an int: torch.cuda resolves an int without a device lookup.
        self.index: int = device.index if device.index is not None else torch.cuda.current_device()
        self.stream = _copy_streams.LENDER.lend(device, self)
        self.source_stream = _copy_streams.LENDER.lend(device, self)
        #: Per thread, where it is known (see ``_settle``): ``source`` and ``copy``, the
        #: contexts that make each stream current and set the thread's resting one back;
        #: ``here``, True while the consumer pulls a batch itself, its resting stream current;
        #: and ``pulling``, the last :meth:`pull_context`, kept for the next pull from its stream.
        self._known = threading.local()

    def source_context(self) -> contextlib.AbstractContextManager[Any]:
        """The target device and the source stream, current while the source runs."""
        known: _Use | None = getattr(self._known, "source", None)
        if known is not None:
            return known
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(self.source_stream))
            return stack.pop_all()

    def pull_context(self) -> contextlib.AbstractContextManager[Any]:
        """Around a batch the consumer pulls itself: its streams known for the pull's length.

        Only where the target is its current device; elsewhere torch's contexts are entered
        per call, as they also set the device and set it back.
        """
        if getattr(self._known, "source", None) is not None:
            return contextlib.nullcontext()  # known already (the producer thread)
        if torch.cuda.current_device() != self.index:
            return contextlib.nullcontext()
        rest = torch.cuda.current_stream(self.index)
        known = self._known
        pulling: _Pulling | None = getattr(known, "pulling", None)
        if pulling is None or pulling.rest != rest:  # made once per resting stream, not per pull
            pulling = known.pulling = _Pulling(self, rest)
        return pulling

    def _settle(self, rest: torch.cuda.Stream | None) -> None:
        """This thread has the target current and ``rest`` current on it (None: unknown)."""
        known = self._known
        known.source = None if rest is None else _Use(self.source_stream, rest)
        known.copy = None if rest is None else _Use(self.stream, rest)

    def before_epoch(self) -> None:
        """Order the source stream after the work queued so far on the opening thread's stream.

        Called where an epoch's iterator is made: GPU data prepared before the loop (a
        dataset normalised on the GPU) is finished before the source reads it, as when the
        source ran on that stream itself. Once per epoch, not per batch: a wait per batch
        would queue every copy behind the model's kernels.
        """
        self.source_stream.wait_stream(torch.cuda.current_stream(self.device))

    def start_thread(self) -> None:
        """Also make the target the producer thread's current device (pinning, events use it).

        Its current stream there is its default one, known from now on: nostall changes it
        in this thread only through ``_Use``, which sets it back, also after the user's code
        that runs inside (the source, the transform) changed it.
        """
        super().start_thread()
        torch.cuda.set_device(self.device)
        self._settle(torch.cuda.current_stream(self.index))

    def stage(self, batch: Any) -> Staged:
        """Pin and copy ``batch`` on the copy stream, transform it, record its ready event."""
        if self.transform is None and (type(batch) is tuple or type(batch) is list):
            flat = self._stage_flat(batch)
            if flat is not None:
                return flat
        copies: list[torch.Tensor] = []
        due: list[DueWarning] = []
        # Device tensors, and subclasses (which may keep more tensors in attributes): with
        # neither, every device tensor the batch will hold is a copy made here (see below).
        odd = [t for t in iter_tensors(batch) if t.is_cuda or type(t) is not torch.Tensor]
        on_device = [t for t in odd if t.is_cuda and t.device == self.device]
        self._after_source(on_device)
        with getattr(self._known, "copy", None) or torch.cuda.stream(self.stream):
            moved = map_tensors(batch, self._leaf_mover(copies), self._object_mover(copies, due))
            protect = copies
            if self.transform is not None:
                # On the copy stream too: it overlaps the model's compute, and the consumer's
                # wait on the event covers it. The copied inputs die here, on this stream;
                # only the outputs need protecting for the consumer.
                self._keep_for_copy_stream(on_device)
            moved, transform_state = self._transform_step(moved)
            if self.transform is not None or odd:
                # Every device tensor handed out is protected, also those the source put on
                # the device itself inside an object nostall does not move (their blocks
                # belong to the source thread's stream, whose next allocations could reuse
                # them), and the transform's outputs, which replace the copies. Without
                # either, the copies are all of them: each leaf's copy and each moved
                # object's device tensors are in ``copies``, an object left unmoved holds
                # host tensors only, and no walk of the moved batch is needed.
                keep = [] if self.transform is not None else protect
                protect = _unique(keep + [t for t in iter_tensors(moved) if t.is_cuda])
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self.stream)
        return Staged(moved, ready, protect, transform_state, tuple(due))

    def _stage_flat(self, batch: tuple[Any, ...] | list[Any]) -> Staged | None:
        """:meth:`stage` of the common batch in one pass, or None for any other batch.

        The common batch: a tuple or list of plain, strided host tensors, and no transform.
        What the general walk does for it, without the walk: each tensor pinned (compacted
        first) and copied on the copy stream, the copies protected for the consumer, the
        ready event recorded; nothing the source put on the device, so nothing to wait for.
        """
        size = 0
        for t in batch:
            if type(t) is not torch.Tensor or not t.is_cpu or t.layout != torch.strided:
                return None
            size += t.nbytes
        if size <= self.HERE_BYTES and self.pin and getattr(self._known, "here", False):
            return self._stage_here(batch)
        self._after_source([])  # no device tensors: no wait (kept for its canary)
        device, pin, copies = self.device, self.pin, []
        with getattr(self._known, "copy", None) or torch.cuda.stream(self.stream):
            for t in batch:
                pinned = t.is_pinned()
                if pin and not pinned:
                    if not t.is_contiguous():  # compact() is t itself where it is contiguous
                        t = compact(t)
                    t, pinned = t.pin_memory(), True
                copies.append(t.to(device, non_blocking=pinned))
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self.stream)
        moved = tuple(copies) if type(batch) is tuple else list(copies)
        return tuple.__new__(Staged, (moved, ready, copies, None, ()))

    def _stage_here(self, batch: tuple[Any, ...] | list[Any]) -> Staged:
        """A small common batch the consumer pulls itself, copied on its own current stream.

        As a plain ``.to()`` loop: pinned (so the copy does not wait for the model's queued
        work, as a pageable one would), then copied in stream order. No ready event: the
        consumer's kernels queued later on this stream come after the copy; nothing to
        protect: the copies were allocated on this stream. :meth:`hand_out` hands it out as
        it is.
        """
        device, pin, copies = self.device, self.pin, []
        for t in batch:
            pinned = t.is_pinned()
            if pin and not pinned:
                if not t.is_contiguous():
                    t = compact(t)
                t, pinned = t.pin_memory(), True
            copies.append(t.to(device, non_blocking=pinned))
        moved = tuple(copies) if type(batch) is tuple else copies
        return tuple.__new__(Staged, (moved, None, [], None, ()))

    def _after_source(self, on_device: list[torch.Tensor]) -> None:
        """Order the copy stream after the work that wrote the source's device tensors.

        They were written on the source stream (whichever thread ran the source), so the copy
        stream (and the event the consumer waits on) must come after that work. Only then,
        and only on the source stream: a wait on the model's stream would queue every copy
        behind the model's kernels, and no copy could overlap them.
        """
        if on_device:
            self.stream.wait_stream(self.source_stream)

    def _keep_for_copy_stream(self, on_device: list[torch.Tensor]) -> None:
        """Keep the source's device tensors' memory until the copy stream has read them.

        Without this their blocks would return to their own stream's pool when they die here,
        and the source's next batch could overwrite them while the transform still reads.
        """
        for t in on_device:
            record_stream(t, self.stream)

    def _leaf_mover(self, out: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        device, pin = self.device, self.pin

        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                pinned = t.is_pinned()
                if pin and not pinned:
                    t, pinned = compact(t).pin_memory(), True
                t = t.to(device, non_blocking=pinned)
            elif t.device != device:
                t = t.to(device)  # a batch on another GPU: moved explicitly, never left behind
            if t.is_cuda:
                out.append(t)
            return t

        return move

    def _object_mover(self, out: list[torch.Tensor], due: list[DueWarning]) -> Callable[[Any], Any]:
        device, pin = self.device, self.pin

        def move(obj: Any) -> Any:
            if not callable(getattr(obj, "to", None)):
                return UNHANDLED
            pinned = _pinned_object(obj, due) if pin else UNHANDLED
            # non_blocking only from pinned memory: from pageable memory the copy is
            # synchronous anyway, and a non_blocking one hides that.
            if pinned is UNHANDLED:
                moved = call_to(obj, device, False)
            else:
                moved = call_to(pinned, device, True)
            if getattr(moved, "read_on_host", False) is True:
                return moved  # kept on the host by design (encoded images a decoder reads)
            seen = _unique(list(iter_tensors(moved)))
            found = [t for t in seen if t.is_cuda]
            before = len(_unique(list(iter_tensors(obj))))
            # Fewer tensors seen after .to() than before (or none on the device, from an
            # object that had some): it kept some where nostall cannot look.
            if before and (not found or len(seen) < before):
                _hidden_tensors(type(obj), type(moved), due)
            out.extend(found)
            return moved

        return move

    def check_consumer(self) -> None:
        """Refuse to hand out a batch while the consumer's stream captures a CUDA graph.

        The wait for the copy stream's event and the ``record_stream`` calls would be captured
        into the graph, and every replay would read the memory of this one batch.
        """
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a nostall prefetcher cannot hand out batches while a CUDA graph is being "
                "captured on the current stream: the graph would replay this one batch. Take "
                "the batch before the capture and copy it into the graph's static input "
                "(static_input.copy_(batch); graph.replay()) in the loop"
            )

    def hand_out(self, staged: Staged) -> Any:
        """Make the caller's current stream wait for the batch and protect its memory.

        A batch without a ready event was copied on this very stream (:meth:`_stage_here`),
        in this ``next()``: it is handed out as it is.
        """
        if staged.ready is None:
            return staged.batch
        consumer = torch.cuda.current_stream(self.index)
        self._wait(consumer, staged.ready)
        self._keep_for_consumer(consumer, staged.tensors)
        if staged.due:
            _warn_due(staged.due)
        return staged.batch

    @staticmethod
    def _wait(consumer: torch.cuda.Stream, ready: torch.cuda.Event | None) -> None:
        """The consumer's kernels queued from now on start after the batch is written."""
        if ready is not None:
            consumer.wait_event(ready)

    @staticmethod
    def _keep_for_consumer(consumer: torch.cuda.Stream, tensors: list[torch.Tensor]) -> None:
        """Keep the batch's memory out of the copy stream's pool until the consumer used it."""
        for t in tensors:
            if t.layout == torch.strided and not t.is_nested:
                t.record_stream(consumer)  # the common tensor: its own storage, one call
            else:
                record_stream(t, consumer)


class _Use:
    """``stream`` current in the block, then ``rest``, in a thread where ``rest`` is current.

    What ``torch.cuda.stream(stream)`` does there (and ``torch.cuda.device`` of the target:
    setting a stream makes its device current, and ``rest`` is on the target), without
    asking torch which stream and device are current: two calls instead of about a dozen.
    """

    __slots__ = ("rest", "stream")

    def __init__(self, stream: torch.cuda.Stream, rest: torch.cuda.Stream) -> None:
        self.stream, self.rest = stream, rest

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.cuda.set_stream(self.rest)


class _Pulling:
    """The consumer pulls a batch itself, ``rest`` current on the target: known till the end.

    What ``staging._settle(rest)`` and ``staging._settle(None)`` do around the pull, with the
    two contexts made once, not per pull.
    """

    __slots__ = ("copy", "known", "rest", "source")

    def __init__(self, staging: CudaStaging, rest: torch.cuda.Stream) -> None:
        self.known, self.rest = staging._known, rest
        self.source, self.copy = _Use(staging.source_stream, rest), _Use(staging.stream, rest)

    def __enter__(self) -> None:
        known = self.known
        known.source, known.copy, known.here = self.source, self.copy, True

    def __exit__(self, *exc: object) -> None:
        known = self.known
        known.source = known.copy = None
        known.here = False


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` without repeats (by identity), in order."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]  # type: ignore[func-returns-value]


def _pinned_object(obj: Any, due: list[DueWarning]) -> Any:
    """``obj`` ready for a ``non_blocking`` copy, or :data:`UNHANDLED` (then copied blocking).

    In order: its own ``pin_memory()``; a Mapping or dataclass with ``.to()`` and no
    ``pin_memory()`` (Hugging Face's ``BatchEncoding``, many collators' outputs) gets a copy
    with its values pinned, as torch's own ``pin_memory`` treats a Mapping; an object whose
    every tensor nostall can see is pinned already goes as it is. Anything else is warned
    about once per type (added to ``due``): its tensors may be pageable.
    """
    pinned = call_pin_memory(obj)
    if pinned is not UNHANDLED:
        return pinned
    # Only types whose shallow copy owns its items (a dict subclass, a UserDict: its __copy__
    # copies .data, a dataclass): another Mapping's copy may share its storage with the
    # user's object, which the update would then fill with pinned copies.
    if isinstance(obj, (dict, collections.UserDict)) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, type)
    ):
        try:
            return _with_pinned_values(obj)
        except Exception:  # a type that cannot be copied so: a blocking copy is still correct
            pass
    tensors = list(iter_tensors(obj))
    if tensors and all(t.device.type != "cpu" or t.is_pinned() for t in tensors):
        return obj
    _unpinnable(type(obj), due)
    return UNHANDLED


def _with_pinned_values(obj: Any) -> Any:
    """A shallow copy of a Mapping or dataclass ``obj`` whose values are pinned."""
    pin = functools.partial(map_tensors, on_tensor=_pinned, on_object=call_pin_memory)
    clone = copy.copy(obj)
    if isinstance(obj, (dict, collections.UserDict)):
        clone.update({k: pin(v) for k, v in obj.items()})
    else:
        for field in dataclasses.fields(obj):
            object.__setattr__(clone, field.name, pin(getattr(obj, field.name)))
    return clone


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t


#: The warnings raised so far, by key: each once per process.
_WARNED: set[tuple[str, type]] = set()


def _warn_due(due: tuple[DueWarning, ...]) -> None:
    """Raise the warnings found while staging a batch, in the consumer's thread.

    Each key is marked warned here, when raised, not when found: a batch fetched ahead and
    never handed out (a loop that breaks) takes no warning with it.
    """
    for key, message in due:
        if key not in _WARNED:
            _WARNED.add(key)
            warn(message)


def _unpinnable(kind: type, due: list[DueWarning]) -> None:
    """Once per type: its copies to the GPU may be synchronous, and how to make them overlap."""
    key = ("unpinnable", kind)
    if key in _WARNED:
        return
    message = (
        f"{kind.__qualname__} objects have .to() but no .pin_memory(), and nostall cannot see "
        f"that all their tensors are pinned: their copies to the GPU may be from pageable "
        f"memory, which blocks the producer until each copy is done; give "
        f"{kind.__qualname__} a pin_memory() method that returns a copy in pinned memory (as "
        f"tensor.pin_memory() does) to let the copies overlap the model's work"
    )
    due.append((key, message))


def _hidden_tensors(kind: type, moved: type, due: list[DueWarning]) -> None:
    """Once per type: what its ``.to()`` returned hides tensors nostall cannot protect."""
    key = ("hidden", kind)
    if key in _WARNED:
        return
    message = (
        f"{kind.__qualname__}.to() returned a {moved.__qualname__} in which nostall cannot find "
        f"all the tensors it copied to the GPU (they are kept where nostall does not look: a C "
        f"object, a closure, ...): their memory is not protected for your stream, and the "
        f"caching allocator may hand it to the next batch's copy while your kernels still "
        f"read it. Keep the tensors in attributes, fields, lists, tuples, dicts or sets, or "
        f"synchronize (torch.cuda.current_stream().synchronize()) before dropping a batch"
    )
    due.append((key, message))
