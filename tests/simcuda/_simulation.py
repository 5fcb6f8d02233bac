"""The ordering model: streams, events, the host, and the hazards found while checking them.

Every kernel is a step on one stream. Each stream keeps a vector clock (``known``): for every
stream, the last kernel known to have finished before this stream's next kernel starts. A
kernel's own step is one more than the last on its stream; events snapshot a stream's clock;
a wait merges a snapshot into the waiting stream's clock; a host sync merges a stream's clock
into the host's, and every later kernel starts after everything the host has seen (the host
queued it later). This is the model of PyTorch's CUDA sanitizer (``torch.cuda._sanitizer``).

A second clock per stream (``waited``) follows waits only, not the host: the work a stream
truly depends on. A copy whose waits end on model work the host has not seen finish is a false
dependency: on a GPU it could not overlap that work. The mirror image: the model's stream waiting
for more of a nostall stream's work than its next kernels read (a hand-out that waits for
batches copied ahead, not only its own) is lost overlap.

Time: work is done only when the host knows it is. The host learns it by a sync
(``synchronize()``, ``.item()``, a blocking copy) or when a test says time passed
(:meth:`Simulation.time_passes`); ``Event.query()`` and ``Stream.query()`` answer "not done"
until then, and a poll is never taken as a sync. The allocator, too, reuses memory kept for
other streams only once the host knows they passed: late, never early.

Devices: ``torch.cuda.stream(s)`` makes ``s``'s device current and, on exit, makes the previous
stream's device current again with ``set_stream`` (an eager ``cudaSetDevice``, which creates
that device's primary context), as torch does; ``torch.cuda.device(d)`` on exit only notes the
previous device (torch's ``MaybeSetDevice``: no context). ``contexts`` lists the devices with a
primary context; a nostall thread that creates one on a device the process had not used costs
every process (every DDP rank) hundreds of MiB there: a hazard.

Capture (``torch.cuda.graph``): the capturing thread's current stream is the capture stream;
what this model holds for certain (the CUDA programming guide) is checked: a capture stream
cannot be synchronized or queried, nor the whole device synchronized from the capturing thread
(or, in ``"global"`` mode, from any thread), and a stream that waits on an event recorded in
the capture joins it (its later work is captured, not run). Other threads' work on their own
streams (the producer pinning and copying) runs as usual in every mode, as an H100 with torch
2.11 showed.

Invariants:
    * Access A (stream s, step n) is ordered before a kernel on stream t iff s == t or
      ``known[t][s] >= n``. Time never enters: the model is exact about ordering and says
      nothing about speed.
    * All state is guarded by one lock; the CPU work of a kernel runs outside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import torch

from ._hazards import Hazard, Kind, caller, created_by_nostall
from ._memory import Access, Allocator, Block

Clock = dict[int, int]

_ACTIVE: Simulation | None = None

#: Streams per device that ``torch.cuda.Stream()`` cycles through (PyTorch's pool size).
STREAM_POOL = 32


def active() -> Simulation:
    """The simulation in force (``simulated_cuda()``); raises outside one."""
    if _ACTIVE is None:
        raise RuntimeError("simulated CUDA is not active")
    return _ACTIVE


def _merge(into: Clock, other: Clock) -> None:
    for key, value in other.items():
        if into.get(key, 0) < value:
            into[key] = value


def device_index(device: Any) -> int:
    """A CUDA index from what torch.cuda functions accept (None: the current device)."""
    if device is None:
        return active().current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device!r}")
    return active().current_device() if dev.index is None else dev.index


class SimStream:
    """``torch.cuda.Stream`` in the simulation; ``library`` marks streams nostall created."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        sim = active()
        self.device_index = device_index(device)
        self.device = torch.device("cuda", self.device_index)
        self.priority = priority
        self.library = created_by_nostall()
        self.id = sim.register_stream(self)
        if not sim._making_default:
            sim.use_context(self.device_index)  # created under ``torch.cuda.device(device)``

    @property
    def cuda_stream(self) -> int:
        """A stable integer handle, as the real attribute."""
        return self.id

    def wait_event(self, event: SimEvent) -> None:
        """Kernels queued here after this call start after ``event``'s work."""
        active().wait(self, event)

    def wait_stream(self, stream: SimStream) -> None:
        """Kernels queued here after this call start after the work queued on ``stream`` now."""
        self.wait_event(stream.record_event())

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        """Record ``event`` (a new one if None) on this stream."""
        event = SimEvent() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        """The host waits for all work queued here."""
        sim = active()
        sim.check_capture_sync(self, "Stream.synchronize()")
        sim.host_sync(sim.clock_of(self), "Stream.synchronize()", self.device_index)

    def query(self) -> bool:
        """Done only if the host knows all work queued here finished (see the module doc)."""
        sim = active()
        sim.check_capture_sync(self, "Stream.query()")
        with sim.lock:
            clock = sim.clock_of(self)
            done = sim.host.get(self.id, 0) >= clock.get(self.id, 0)
            if done:
                _merge(sim.host, clock)
        return done

    def __enter__(self) -> SimStream:
        self._context = active().use_stream(self)
        self._context.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._context.__exit__(kind, error, traceback)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SimStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("stream", self.id))

    def __repr__(self) -> str:
        kind = "nostall" if self.library else "user"
        return f"<SimStream {self.id} on cuda:{self.device_index} ({kind})>"


class SimEvent:
    """``torch.cuda.Event`` in the simulation: a snapshot of a stream's clocks."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, **_: Any) -> None:
        self.known: Clock = {}
        self.waited: Clock = {}
        self.stream: SimStream | None = None
        #: Recorded on a stream that was capturing a graph at the time.
        self.captured = False

    def record(self, stream: SimStream | None = None) -> None:
        """Snapshot ``stream`` (the current stream if None) as it is now."""
        sim = active()
        stream = sim.current_stream(None) if stream is None else stream
        with sim.lock:
            self.stream = stream
            self.captured = stream.id in sim.capturing
            self.known = dict(sim.known[stream.id])
            # A waiter depends on everything queued on ``stream`` so far, by a wait.
            self.waited = dict(sim.waited[stream.id])
            self.waited[stream.id] = sim.known[stream.id].get(stream.id, 0)

    def wait(self, stream: SimStream | None = None) -> None:
        """``stream`` (the current one if None) waits for this event."""
        (active().current_stream(None) if stream is None else stream).wait_event(self)

    def synchronize(self) -> None:
        """The host waits for the recorded work."""
        sim = active()
        device = None if self.stream is None else self.stream.device_index
        if self.stream is not None and self.captured:
            sim.check_capture_sync(self.stream, "Event.synchronize()")
        sim.host_sync(self.known, "Event.synchronize()", device)

    def query(self) -> bool:
        """Done only if the host knows the recorded work finished (never recorded: done)."""
        sim = active()
        if self.stream is None:
            return True
        if self.captured:
            sim.check_capture_sync(self.stream, "Event.query()")
        with sim.lock:
            done = sim.host.get(self.stream.id, 0) >= self.known.get(self.stream.id, 0)
            if done:
                _merge(sim.host, self.known)
        return done

    def elapsed_time(self, end: SimEvent) -> float:
        """The model has no time: 0 ms."""
        return 0.0


class Simulation:
    """The state of one simulated machine: devices, streams, clocks, memory and hazards."""

    def __init__(self, device_count: int = 2) -> None:
        self.device_count = device_count
        self.lock = threading.RLock()
        self.hazards: list[Hazard] = []
        self.known: dict[int, Clock] = {}
        self.waited: dict[int, Clock] = {}
        self.host: Clock = {}
        self.streams: dict[int, SimStream] = {}
        self.memory = Allocator()
        #: Pinned host storages (keyed as the allocator's; the weak reference keeps keys unique).
        self.pinned: dict[int, Any] = {}
        #: Steps of the kernels queued as the model's work, per stream.
        self.model_kernels: dict[int, set[int]] = {}
        #: Capturing streams: their capture mode and the capturing thread's ident.
        self.capturing: dict[int, tuple[str, int]] = {}
        #: Devices with a primary context in this (simulated) process.
        self.contexts: set[int] = set()
        #: Per stream of the model's: the nostall streams it waited for, up to which step, not
        #: yet judged (see :meth:`wait`), what its kernels since read of them, and how many
        #: kernels it queued since.
        self.covered: dict[int, Clock] = {}
        self.needed: dict[int, Clock] = {}
        self.since_wait: dict[int, int] = {}
        self.kernels = 0
        self._local = threading.local()
        self._defaults: dict[int, SimStream] = {}
        self._made: dict[int, int] = {}
        self._making_default = False

    # --- streams and devices, per thread ------------------------------------------------

    def register_stream(self, stream: SimStream) -> int:
        """The id of the CUDA stream behind ``stream``, with empty clocks when it is new.

        As in PyTorch, ``torch.cuda.Stream()`` hands out the streams of a per-device pool of
        ``STREAM_POOL`` round robin: two Stream objects may be one CUDA stream (the same clocks
        and the same memory pool). Default streams are outside the pool.
        """
        with self.lock:
            index = stream.device_index
            if self._making_default:
                sid = -1 - index
            else:
                made = self._made.get(index, 0)
                self._made[index] = made + 1
                sid = 1 + index * STREAM_POOL + made % STREAM_POOL
            self.streams[sid] = stream
            self.known.setdefault(sid, {})
            self.waited.setdefault(sid, {})
            return sid

    def default_stream(self, device: Any) -> SimStream:
        """The device's default stream, shared by every thread."""
        index = device_index(device)
        with self.lock:
            if index not in self._defaults:
                self._making_default = True
                try:
                    stream = SimStream(index)
                finally:
                    self._making_default = False
                stream.library = False
                self._defaults[index] = stream
            return self._defaults[index]

    def current_device(self) -> int:
        """This thread's current device (every thread starts on device 0, as with CUDA)."""
        return int(getattr(self._local, "device", 0))

    def set_device(self, device: Any, lazy: bool = False) -> None:
        """Set this thread's current device: eagerly (``cudaSetDevice``) unless ``lazy``."""
        index = device_index(device)
        if not 0 <= index < self.device_count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        if not lazy and index != self.current_device():
            self.use_context(index)
        self._local.device = index

    def use_context(self, index: int) -> None:
        """Device ``index`` is used for real: its primary context exists from now on.

        A nostall thread that creates one where the process had none is a hazard: the
        context costs memory on a GPU the user's process does not otherwise touch.
        """
        with self.lock:
            if index in self.contexts:
                return
            self.contexts.add(index)
        thread = threading.current_thread().name
        if thread.startswith("nostall"):
            self.report(
                Kind.STRAY_CONTEXT,
                f"thread {thread!r} created a CUDA context on cuda:{index}, a device this "
                f"process had not used",
            )

    def current_stream(self, device: Any) -> SimStream:
        """This thread's current stream on ``device`` (its default stream until set)."""
        index = device_index(device)
        streams = getattr(self._local, "streams", None)
        if streams is None:
            streams = self._local.streams = {}
        return streams.get(index) or self.default_stream(index)

    def set_stream(self, stream: SimStream) -> None:
        """``torch.cuda.set_stream``: ``stream`` current on its device, that device current.

        As torch's ``_cuda_setStream``: the device is set eagerly when it changes.
        """
        self.current_stream(stream.device_index)  # creates the per-thread table
        self.set_device(stream.device_index)
        self._local.streams[stream.device_index] = stream

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream | None) -> Iterator[None]:
        """``torch.cuda.stream(stream)``, step by step as torch's ``StreamContext`` does it."""
        if stream is None:
            yield
            return
        src_prev = self.current_stream(None)
        dst_prev = self.current_stream(stream.device_index)
        if src_prev.device_index != stream.device_index:
            self.use_context(stream.device_index)  # ``with device(stream.device)``
        self.set_stream(stream)
        try:
            yield
        finally:
            if src_prev.device_index != stream.device_index:
                self.set_stream(dst_prev)
            self.set_stream(src_prev)  # back on the previous device: eagerly

    @contextlib.contextmanager
    def model_work(self) -> Iterator[None]:
        """Mark the kernels this thread queues in the block as the model's work."""
        self._local.model = True
        try:
            yield
        finally:
            self._local.model = False

    # --- ordering -------------------------------------------------------------------------

    def clock_of(self, stream: SimStream) -> Clock:
        """What ``stream`` knows now, with its own last step."""
        return self.known[stream.id]

    def launch(self, stream: SimStream) -> int:
        """Queue one kernel on ``stream``; return its step. Caller holds the lock."""
        known = self.known[stream.id]
        _merge(known, self.host)  # queued after every host sync so far
        step = known.get(stream.id, 0) + 1
        known[stream.id] = step
        self.kernels += 1
        if stream.library or not created_by_nostall():
            # Not counted: nostall's own copies on a stream of the model's (a small batch the
            # consumer pulled itself is copied on its stream): they are not the model's kernels.
            self.since_wait[stream.id] = self.since_wait.get(stream.id, 0) + 1
        if stream.device_index not in self.contexts:
            self.use_context(stream.device_index)
        if getattr(self._local, "model", False):
            self.model_kernels.setdefault(stream.id, set()).add(step)
        return step

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        """``stream`` waits for ``event``.

        A nostall stream that waits on an event recorded in a graph capture joins the capture
        (a hazard). When a stream of the model's waits on a nostall stream's event, the wait
        is judged once the model queued kernels after it: the steps it covered must all be
        read by those kernels (see :meth:`_judge`).
        """
        origin = event.stream
        if event.captured and stream.library and origin is not None:
            self.report(
                Kind.CAPTURE,
                f"{stream!r} waits on an event recorded while {origin!r} captured a graph: it "
                f"joins the capture, and its work is captured instead of run",
            )
        with self.lock:
            if origin is not None and origin.library and not stream.library:
                self._judge(stream)
                covered = self.covered.setdefault(stream.id, {})
                step = event.waited.get(origin.id, 0)
                if step > max(covered.get(origin.id, 0), self.known[stream.id].get(origin.id, 0)):
                    covered[origin.id] = step
            _merge(self.known[stream.id], event.known)
            _merge(self.waited[stream.id], event.waited)

    def _judge(self, stream: SimStream) -> None:
        """Lost overlap: ``stream`` waited for nostall work its kernels since did not read.

        A hand-out waits on its own batch's event; the kernels queued after it (up to the next
        such wait) read that batch, whose last write is the last step the event covers. Steps
        beyond what they read are later batches' copies the model's kernels were made to wait
        for. Judged at the next such wait, so a consumer that takes several
        batches before its kernels read them is judged on the waits together; one whose
        kernels between two hand-outs read only older batches would be flagged too (no test
        here does that). Caller holds the lock.
        """
        if not self.since_wait.get(stream.id):
            return  # nothing queued since the last wait: the waits add up
        needed = self.needed.pop(stream.id, {})
        for other, step in self.covered.pop(stream.id, {}).items():
            if needed.get(other, 0) < step:
                self.hazards.append(
                    Hazard(
                        Kind.LOST_OVERLAP,
                        f"{stream!r} waited for kernel {step} of {self.streams[other]!r} but "
                        f"its next kernels read its work only up to kernel "
                        f"{needed.get(other, 0)}: they wait for copies they do not use",
                        caller(),
                    )
                )
        self.since_wait[stream.id] = 0

    def _note_need(self, stream: SimStream, tenancy: Any) -> None:
        """A kernel on ``stream`` uses memory last written on a nostall stream: it needs it."""
        write = tenancy.last_write
        if write is not None and write.stream != stream.id and not stream.library:
            needed = self.needed.setdefault(stream.id, {})
            if needed.get(write.stream, 0) < write.seq:
                needed[write.stream] = write.seq

    def time_passes(self) -> None:
        """Everything queued so far finishes; the host knows it (no sync, no hazard)."""
        with self.lock:
            for sid, clock in self.known.items():
                if self.host.get(sid, 0) < clock.get(sid, 0):
                    self.host[sid] = clock[sid]

    def check_capture_sync(self, stream: SimStream, what: str) -> None:
        """Synchronizing or querying a stream while it captures a graph is an error in CUDA."""
        if stream.id in self.capturing:
            self.report(Kind.CAPTURE, f"{what} of {stream!r} while it captures a graph")

    def check_device_sync(self, what: str) -> None:
        """A whole-device sync during a capture: the capturing thread, or any in global mode."""
        me = threading.get_ident()
        for sid, (mode, thread) in list(self.capturing.items()):
            if thread == me or mode == "global":
                self.report(
                    Kind.CAPTURE,
                    f"{what} while {self.streams[sid]!r} captures a graph "
                    f"(capture_error_mode={mode!r})",
                )

    def host_sync(self, clock: Clock, what: str, device: int | None) -> None:
        """The host waits for the work in ``clock``; a hazard where nostall must never wait."""
        with self.lock:
            _merge(self.host, clock)
        thread = threading.current_thread().name
        index = self.current_device() if device is None else device
        stream = self.current_stream(index)
        if thread.startswith("nostall") or stream.library:
            place = f"thread {thread!r}"
            if stream.library:
                place += f", current stream {stream!r}"
            self.report(Kind.HOST_SYNC, f"{what} blocks the host in {place}")

    def library_sync(self, stream: SimStream) -> None:
        """A library call made the host wait for its own ``stream``, by design (no hazard).

        torchvision's GPU JPEG decoder ends with ``cudaStreamSynchronize`` on its own stream:
        a test double of it calls this. The host knows that stream's work is done, so work
        queued later on any stream comes after it; nothing else is known done.
        """
        with self.lock:
            _merge(self.host, self.clock_of(stream))

    def report(self, kind: Kind, message: str) -> None:
        """Record a hazard."""
        with self.lock:
            self.hazards.append(Hazard(kind, message, caller()))

    # --- memory accesses -----------------------------------------------------------------

    def access(self, block: Block, stream: SimStream, step: int, write: bool, op: str) -> None:
        """Check one kernel's read or write of ``block`` and add it to the history.

        Caller holds the lock. A read must come after the last write on another stream; a
        write after the last write and every read since. A conflict within the current
        tenancy is a missing wait; with an earlier tenancy of the same bytes (until the
        current tenant's first write settles them) a reuse hazard.
        """
        tenancy = block.tenancy
        if tenancy is None:
            return
        known = self.known[stream.id]
        self._note_need(stream, tenancy)
        # A read follows the last write; a write follows it and every read since.
        before = tenancy.accesses() if write else tenancy.accesses()[:1]
        found = self._unordered(before if write or tenancy.last_write else [], known, stream.id)
        if found is not None:
            self._conflict(block, found, stream, write, op, Kind.UNORDERED)
        elif not tenancy.settled:
            for earlier in self.memory.earlier_tenancies(block):
                prior = self._unordered(earlier.accesses(), known, stream.id)
                if prior is not None:
                    self._conflict(block, prior, stream, write, op, Kind.REUSE)
                    tenancy.settled = True  # reported once; stream order covers the rest
                    break
            else:
                if write:
                    self.memory.settle(block)
        here = Access(stream.id, step, tenancy.tenant, op, caller())
        if write:
            tenancy.last_write, tenancy.reads = here, {}
        else:
            tenancy.reads[stream.id] = here

    @staticmethod
    def _unordered(accesses: list[Access], known: Clock, stream: int) -> Access | None:
        """The first of ``accesses`` on another stream that ``known`` does not cover."""
        for prior in accesses:
            if prior.stream != stream and known.get(prior.stream, 0) < prior.seq:
                return prior
        return None

    def _conflict(
        self, block: Block, prior: Access, stream: SimStream, write: bool, op: str, kind: Kind
    ) -> None:
        earlier = self.streams[prior.stream]
        tenant = "a previous tenant of the memory" if kind is Kind.REUSE else "the same tensor"
        self.hazards.append(
            Hazard(
                kind,
                f"{'write' if write else 'read'} by {op} on {stream!r} is not ordered after "
                f"{prior.op} on {earlier!r} ({tenant}, at {prior.where}); block {block.id} of "
                f"{block.size} B on cuda:{block.device}",
                caller(),
            )
        )

    def check_false_dependency(self, stream: SimStream, what: str) -> None:
        """A copy on a nostall stream must not wait, through waits, for unfinished model work.

        A wait covers a prefix of another stream's queue. When that prefix ends with a kernel
        that is not the model's (a source writing the batch on the GPU), the model work before
        it is a true dependency (stream order: that kernel itself ran after it). When it ends
        with the model's own work, the wait had no reason to cover it: a false dependency.
        """
        if not stream.library:
            return
        with self.lock:
            late = [
                (s, n)
                for s, n in self.waited[stream.id].items()
                if s != stream.id and n in self.model_kernels.get(s, ()) and self.host.get(s, 0) < n
            ]
        if late:
            s, n = late[-1]
            self.report(
                Kind.FALSE_DEPENDENCY,
                f"{what} on {stream!r} waits for model kernel {n} on {self.streams[s]!r}, "
                f"which the host has not seen finish",
            )

    def kinds(self) -> set[Kind]:
        """The kinds of hazard found so far."""
        with self.lock:
            return {h.kind for h in self.hazards}
