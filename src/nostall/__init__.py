"""nostall keeps the GPU fed: it removes input-pipeline stalls from PyTorch training.

``for batch in nostall.prefetch(loader): ...`` yields the loader's batches, in order, already on
the device: fetched, pinned and copied in the background while the model computes.

The data path, one private module per stage, in the order a batch goes through them. Each
module drawn imports, of those drawn, only those above it (a stage's helpers are drawn above the
stage that uses them); the modules they share and do not draw (``_exceptions``, ``_device``,
``_tree``, ``_torch_compat``, ...) import none of them::

    source (a DataLoader, a list, a generator)
      |   _fabric         Lightning Fabric's loader: the iter() count that sets its epoch
      |   _sources        what the source is, decided once: the kind every other module asks
      |   _webdataset     webdataset pipelines: the shuffles a resume cannot draw again
      |   _sharding       shard=True: each rank's part of an unsharded loader
      |   _generators     the global random generators: where they are, moved or not, put back
      |   _global_draws   a source that draws from the global generators is pulled in step
      |   _pool           the loading threads: tasks in order, started on demand, idle ones end
      |   _threads        threads=: the loader's samples fetched by loading threads, in order
      |   _threaded_stream  threads= over an IterableDataset: N threads as N workers, in turn
      |   _threadable     whether threads= can load a source, checked once, with the fix
      |   _samplers       what the sampler says and does: set_epoch, its epoch, generators
      |   _skip           skipping the batches of an epoch already handed out, on resume
      |   _drawn_orders   what each epoch's order was drawn from, to draw it again on resume
      |   _epochs         opening the source's epochs: set_epoch, the order drawn, replays
      |   _source_checks  what cannot run ahead is refused, what cannot be exact is warned of
      |   _transfer       the moves themselves: pin_memory, to_device, record_stream
      |   _staging_base   per batch: copy -> transform (CPU, XPU; on MPS in the consumer's thread)
      |   _staging_cuda   on CUDA: pin -> copy on a side stream -> transform -> ready event
      v
    _staging      which staging a device gets: streams on CUDA, the consumer's thread on MPS
      v
    _channel      the bounded hand-off between two threads: at most ``depth`` ahead, in order
      ^
    _producer     the puller fills it: next(source), staging, error notes, the epoch's end and
      |           the next epoch's start; in a background thread, or in the consumer's when
      |           it would only wait
      |   _producer_thread  the puller's thread; the threads exit and fork() stop
      |   _latest_producer  one producer at a time: waited for, let go when stuck, joined
      |   _autodepth      how deep depth="auto" may grow: one memory budget
      |   _resume         where the consumer is (one Position value), the state_dict from it
      |   _lineage        what one pass hands the next: the position, the producer ahead
      |   _profile        the waits, recorded when profile=True (and nostall.profile)
      |   _settings       the arguments after the source: one frozen value, checked once
      v
    _iteration    next() empties it: the consumer's stream waits, the batch is handed out
      |   _loader_attributes  a drop-in: the loader's attributes read and set through it
      v
    _prefetcher   the facade: prefetch(), Prefetcher (set_epoch, state_dict, close)

Above the facade, the tools that run it: ``_tune`` (the search, each trial a ``_trial``, with
``_thread_safety`` checked before threads are tried), ``_doctor`` (the measuring;
``_diagnosis`` says what the figures mean, ``_doctor_report`` writes them), ``_cli``, and
``bench``.

Arguments are checked in ``_arguments`` (``TypeError`` for a wrong type, ``ValueError`` for a
wrong value); ``_device`` resolves ``device=``; every warning goes through ``_warn``, which
names the user's line.
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
