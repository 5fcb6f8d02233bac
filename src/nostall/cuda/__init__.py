"""The GPU toolkit: nested batches moved, devices and memory, sync-aware timing, streams.

``nostall.prefetch`` does all of this for a training loop; these are the pieces, for code of
your own. Each works on the CPU too (where there is nothing to synchronise or pin, it says so
or does the plain thing).

Inside nostall it is the wing every GPU move goes through, and a leaf: it imports only the
modules shared at the top (``_device``, ``_exceptions``, ``_torch_compat``). Its part of the
data path, for each batch the staging moves::

    _tree (walk the nested batch) -> _transfer (pin_memory, to_device, record_stream)
    _devices, _timing, _streams: what the device is, how long its work took, side streams
"""

from __future__ import annotations

from ._devices import DeviceInfo, MemoryReport, devices, memory_report, release_cached_memory
from ._streams import run_concurrently
from ._timing import Measured, Timer, Timing, timeit
from ._transfer import pin_memory, to_device

__all__ = [
    "DeviceInfo",
    "Measured",
    "MemoryReport",
    "Timer",
    "Timing",
    "devices",
    "memory_report",
    "pin_memory",
    "release_cached_memory",
    "run_concurrently",
    "timeit",
    "to_device",
]

for _name in __all__:
    globals()[_name].__module__ = __name__  # users meet them as nostall.cuda.X
del _name
