"""What the simulated CUDA reports: one :class:`Hazard` per unsafe or stalling use of the device."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from types import FrameType


class Kind(enum.Enum):
    """The hazards the simulation finds, each named for the protection that is missing."""

    #: An access not ordered after a conflicting access on another stream: a wait is missing.
    UNORDERED = "unordered access (missing wait)"
    #: Memory handed to a new tensor while another stream may still use the previous tenant:
    #: a ``record_stream`` is missing.
    REUSE = "memory reused while another stream may use it (missing record_stream)"
    #: The host waits for the device inside nostall's producer thread or on its copy stream.
    HOST_SYNC = "blocking host sync in the copy path"
    #: ``non_blocking=True`` from pageable memory: the copy is silently synchronous.
    PAGEABLE_NON_BLOCKING = "non_blocking copy from unpinned memory"
    #: A copy on the copy stream ordered after model work on another stream that the host has
    #: not seen finish: the copy cannot overlap that work.
    FALSE_DEPENDENCY = "copy ordered after model work (false dependency)"
    #: Tensors, or a tensor and a stream, of different devices used together.
    WRONG_DEVICE = "tensors or streams of different devices"
    #: The model's stream waits for more of a nostall stream's work than its kernels then read
    #: (a hand-out that waits for the batches copied ahead too): the overlap is lost.
    LOST_OVERLAP = "the model's kernels wait for copies they do not read (lost overlap)"
    #: A nostall thread created a CUDA context on a device the process had not used.
    STRAY_CONTEXT = "CUDA context created on a device the process does not use"
    #: The host used the result of an asynchronous device-to-host copy before a sync.
    UNSYNCED_HOST_READ = "host read of a non_blocking device-to-host copy before a sync"
    #: What CUDA forbids during graph capture: syncing or querying a capturing stream, a
    #: device-wide sync, a nostall stream joining the capture.
    CAPTURE = "forbidden during CUDA graph capture"


@dataclass(frozen=True)
class Hazard:
    """One finding: its kind, what happened, and where in the calling code."""

    kind: Kind
    message: str
    where: str

    def __str__(self) -> str:
        return f"{self.kind.name}: {self.message} [at {self.where}]"


_SKIPPED = ("/torch/", "/simcuda/", "/threading.py", "/contextlib.py", "/functools.py")


def caller() -> str:
    """``file:line`` of the innermost frame outside torch and this simulation (cheap)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _SKIPPED):
            short = name.rsplit("/src/", 1)[-1].rsplit("/tests/", 1)[-1]
            return f"{short}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def created_by_nostall() -> bool:
    """Whether the innermost frame outside torch and this simulation is nostall's own code."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _SKIPPED):
            return str(frame.f_globals.get("__name__", "")).startswith("nostall")
        frame = frame.f_back
    return False
