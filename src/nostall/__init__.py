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

import types as _types

from . import cuda, transforms
from ._engine.profile import Profiled, StallReport, profile
from ._exceptions import (
    DeviceUnavailableError,
    NostallError,
    PrefetcherClosedError,
    PrefetchTimeoutError,
    ProducerDiedError,
    ProfilingDisabledError,
)
from ._loading.collate import collate_uint8
from ._prefetcher import Prefetcher, prefetch
from ._tools.thread_safety import ThreadSafety
from ._tools.tune import Setting, TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "DeviceUnavailableError",
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

# Users meet these as ``nostall.X`` (in reprs, tracebacks, docs): say so, whichever private
# module defines them. Pickles name them there too, which the exports above resolve.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) or (callable(_obj) and not isinstance(_obj, _types.ModuleType)):
        _obj.__module__ = __name__
del _name, _obj
