"""nostall keeps the GPU fed: it removes input-pipeline stalls from PyTorch training.

``for batch in nostall.prefetch(loader): ...`` yields the loader's batches, in order, already on
the device: fetched, pinned and copied in the background while the model computes.

The private code is in wings, one package per part of the data path, each importing only the
wings above it (the table and its test: ``tests/test_architecture.py``)::

    cuda        the public GPU toolkit: nested batches moved, devices, timing, streams
    _clients    what nostall knows of each framework's loader (Fabric, accelerate, Lightning)
    _staging    host to device: pin, copy on a side stream, transform, ready event
    _sources    what the source is, decided once: kind, sampler, global draws, shards
    _loading    threads=: a loader's samples loaded by nostall's threads, and their pacing
    _epochs     opening the source's epochs, the orders drawn, skipping and resuming
    _engine     the hand-off: producer, channel, iteration, lineage, settings, profile
    _prefetcher the facade: prefetch(), Prefetcher (set_epoch, state_dict, close)
    _tools      above the facade: doctor, tune, trial, thread safety, the CLI

A wing is a private package (a leading underscore); the modules inside a private wing drop
the underscore, as the package already marks them private (``_engine/channel.py``). The
public packages ``cuda``, ``transforms`` and ``bench`` keep it on theirs. The modules at the
top are shared by every wing and import none: ``_exceptions``, ``_warn`` (every warning names
the user's line), ``_arguments`` (``TypeError`` for a wrong type, ``ValueError`` for a wrong
value), ``_device``, ``_torch_compat``, ``_stacks``, ``_exit``, ``_thread_bound``,
``_transform_state``; ``_loader_attributes`` is the facade's base class.

One batch in the steady state (a batch ready, no error, no epoch boundary) passes six modules:
in the producer thread, ``_engine.producer_thread`` (its loop) -> ``_engine.producer`` ->
``_staging.cuda`` (or ``_staging.base`` off CUDA) -> ``_engine.channel``; in the consumer's
``next()``, ``_engine.iteration`` -> ``_engine.channel`` -> ``_engine.lineage`` (the position)
-> ``_staging.cuda`` (the consumer's stream waits). A consumer that pulls the batch itself
(see ``_engine.overlap``) goes ``_engine.iteration`` -> ``_engine.producer`` ->
``_staging.cuda`` -> ``_engine.lineage``. Everything decided per epoch or on a rare event
(the draw watch, resume records, the clients, the fork check) is decided as the epoch opens or
read from a flag; ``benchmarks/handoff_calls.py`` counts the calls, and a test holds them.
"""

import importlib as _importlib
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from ._exceptions import (
    DeviceUnavailableError,
    ImageDecodeError,
    NostallError,
    PrefetcherClosedError,
    PrefetchTimeoutError,
    ProducerDiedError,
    ProfilingDisabledError,
)

if _TYPE_CHECKING:
    from . import cuda, transforms
    from ._engine.profile import Profiled, StallReport, profile
    from ._loading.collate import collate_uint8
    from ._prefetcher import Prefetcher, prefetch
    from ._tools.thread_safety import ThreadSafety
    from ._tools.tune import Setting, TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "DeviceUnavailableError",
    "ImageDecodeError",
    "NostallError",
    "PrefetchTimeoutError",
    "Prefetcher",
    "PrefetcherClosedError",
    "ProducerDiedError",
    "Profiled",
    "ProfilingDisabledError",
    "Setting",
    "StallReport",
    "ThreadSafety",
    "TuneResult",
    "__version__",
    "collate_uint8",
    "cuda",
    "prefetch",
    "profile",
    "transforms",
    "tune",
]

#: Where each public name that needs torch lives. They are imported on first use (``import
#: nostall`` itself loads no torch, so that ``nostall --help`` answers at once); the first
#: ``nostall.prefetch`` imports torch and the data path, as ``import nostall`` did.
_HOME = {
    "Prefetcher": "._prefetcher",
    "Profiled": "._engine.profile",
    "Setting": "._tools.tune",
    "StallReport": "._engine.profile",
    "ThreadSafety": "._tools.thread_safety",
    "TuneResult": "._tools.tune",
    "collate_uint8": "._loading.collate",
    "cuda": ".cuda",
    "prefetch": "._prefetcher",
    "profile": "._engine.profile",
    "transforms": ".transforms",
    "tune": "._tools.tune",
}


def _public(value: _Any) -> _Any:
    """``value`` shown as ``nostall``'s own (its ``__module__``), unless a module."""
    if isinstance(value, type) or (callable(value) and not isinstance(value, _types.ModuleType)):
        value.__module__ = __name__
    return value


def __getattr__(name: str) -> _Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _importlib.import_module(home, __name__)
    # Every public name of that module at once, so that each shows as nostall's from the
    # start (a Prefetcher made by prefetch() pickles and prints as nostall.Prefetcher).
    for each, where in _HOME.items():
        if where == home:
            globals()[each] = _public(module if where == f".{each}" else getattr(module, each))
    return globals()[name]


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


for _name in (
    "DeviceUnavailableError",
    "ImageDecodeError",
    "NostallError",
    "PrefetchTimeoutError",
    "PrefetcherClosedError",
    "ProducerDiedError",
    "ProfilingDisabledError",
):
    _public(globals()[_name])
del _name
