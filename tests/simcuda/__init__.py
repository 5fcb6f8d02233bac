"""A simulated CUDA: nostall's unmodified code runs "on cuda" on a CPU-only machine.

Inside ``with simulated_cuda() as sim:`` torch reports ``sim.device_count`` GPUs;
``torch.cuda.Stream``/``Event``/``current_stream``/``stream()``/``synchronize`` and friends,
``Tensor.to``/``cuda``/``cpu``/``pin_memory``/``is_pinned``/``record_stream`` and the tensor
factories are replaced by a model, and "CUDA tensors" are :class:`SimTensor` wrappers over CPU
data. Values are computed on the CPU, so results are exact; what the model adds is the order
of work on streams and the life of device memory, and ``sim.hazards`` lists every breach:

* an access not ordered after a conflicting one on another stream (a missing wait);
* memory reused while another stream may still use it (a missing ``record_stream``), the
  allocator being PyTorch's caching allocator in small: 512-byte rounding, a small and a
  large pool per stream, best fit, block splitting and merging, 2 MiB / 20 MiB segments;
* a blocking host sync (``.item()``, ``synchronize``, a pageable or blocking upload) in
  nostall's producer thread or while a nostall stream is current;
* ``non_blocking=True`` from unpinned memory;
* a copy on a nostall stream that waits for the model's unfinished work (false dependency),
  and the model's stream waiting for nostall work it does not read (lost overlap: a hand-out
  that waits for the batches copied ahead);
* tensors, or a tensor and a stream, of different devices used together;
* a CUDA context a nostall thread creates on a device the process does not use;
* the host using a ``non_blocking`` device-to-host copy's result before a sync;
* what CUDA forbids during graph capture (``torch.cuda.graph`` with each
  ``capture_error_mode``): syncing or querying the capturing stream, a device-wide sync from
  the capturing thread (any thread in ``"global"`` mode), a nostall stream joining the capture.

Time: work is done only when the host knows it is, by a sync or when a test calls
``sim.time_passes()``; ``Event.query()``/``Stream.query()`` say "not done" until then, so a poll
is never taken for a sync.

Pinned host memory: nostall relies on PyTorch's host allocator keeping a pinned buffer until
the copies queued from it have run (``upload()``'s pinned temporaries and the producer's
pinned copies are dropped right after their copy is queued). The model never reuses a pinned
buffer, so it honours that rule by construction; it does not see host writes into pinned
memory (a source that rewrites a pinned buffer it already yielded races the copy).

What it cannot tell: anything about time (overlap, speed), fragmentation beyond the rules
above (no ``expandable_segments``, no ``max_split_size_mb``, no OOM), the numerics of GPU
kernels, driver behaviour beyond the rules above, several processes, what a captured graph
replays. Those need a GPU (``pytest -m cuda``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import _simulation
from ._hazards import Hazard, Kind
from ._patches import replacements
from ._simulation import STREAM_POOL, SimEvent, SimStream, Simulation
from ._tensor import SimTensor

__all__ = [
    "STREAM_POOL",
    "Hazard",
    "Kind",
    "SimEvent",
    "SimStream",
    "SimTensor",
    "Simulation",
    "simulated_cuda",
]


@contextlib.contextmanager
def simulated_cuda(device_count: int = 2) -> Iterator[Simulation]:
    """Run the block on a simulated machine with ``device_count`` GPUs; restore torch after."""
    if _simulation._ACTIVE is not None:
        raise RuntimeError("simulated CUDA is already active")
    sim = Simulation(device_count)
    _simulation._ACTIVE = sim
    saved = []
    try:
        for owner, name, value in replacements():
            saved.append((owner, name, owner.__dict__.get(name, _MISSING)))
            setattr(owner, name, value)
        yield sim
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        _simulation._ACTIVE = None


_MISSING = object()
