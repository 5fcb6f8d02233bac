"""Whether ``threads=`` can load a source: the argument checked once, with the fix."""

from __future__ import annotations

import os
from typing import Any

import torch

from .._clients.accelerate import unthreadable_shard
from .._clients.fabric import threads_refusal
from .._clients.transformers import is_trainer_seed_worker
from .._sources.sources import Client, classify
from .._warn import warn
from .threads import MAX_THREADS

_UNDER_TRAINER = "; under Hugging Face Trainer: TrainingArguments(dataloader_num_workers=0)"


def check_threadable(source: object, threads: object) -> int | None:
    """``threads`` as given to ``prefetch``: None, or an int >= 1 over a DataLoader.

    A DataLoader over a map-style dataset has its samples fetched by index
    (:class:`~nostall._loading.threads.ThreadedEpoch`); one over an ``IterableDataset`` is
    iterated by N threads as by N workers
    (:class:`~nostall._loading.threaded_stream.ThreadedStream`).

    Raises:
        TypeError: ``threads`` is not an int, or the source is not a ``DataLoader`` (an
            ``IterableDataset`` is told to wrap it in one; Fabric's loader is told to pass
            the raw loader with ``shard=True``).
        ValueError: ``threads`` < 1; then, in this order, so that the first refusal's fix is
            one that works: a DataLoader subclass with its own ``__iter__`` (torchdata's
            stateful one), or accelerate's loader over an ``IterableDataset``, which no
            setting makes threadable; a
            loader with worker processes (``num_workers > 0``: the threads replace them, so
            build it without). accelerate's prepared loader is accepted when the
            ``DataLoader`` it iterates is (the threads load that one, inside accelerate's
            iteration), except a dispatcher or a stateful one. Also ``threads`` past
            :data:`MAX_THREADS`.

    Warns (``UserWarning``) when the loader has a ``worker_init_fn``: no thread calls it
    (except Trainer's own, see :func:`nostall._clients.transformers.is_trainer_seed_worker`).
    """
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(
            f"nostall.prefetch(threads=...) must be an int >= 1 or None (got {threads!r}); "
            "pass e.g. threads=4"
        )
    if threads < 1:
        raise ValueError(f"nostall.prefetch(threads=...) must be >= 1 (got {threads}); pass e.g. 4")
    if threads > MAX_THREADS:
        raise ValueError(
            f"nostall.prefetch(threads=...) must be <= {MAX_THREADS} (got {threads}): the "
            f"threads share one GIL, and past about the core count ({os.cpu_count()} here) they "
            f"only add switching; pass e.g. threads=8 (more only for samples that wait on I/O)"
        )
    kind = classify(source)
    if kind.client is Client.FABRIC:
        raise TypeError(threads_refusal(threads))
    if kind.iterable_dataset:  # a webdataset pipeline, WebLoader, HF's stream
        raise TypeError(
            f"threads= loads a DataLoader's batches, and {type(source).__qualname__} is an "
            f"IterableDataset: pass DataLoader(dataset, batch_size=..., num_workers=0) with "
            f"threads=N (N threads then iterate it as N worker processes would), or leave "
            f"threads out"
        )
    if kind.loader is None:  # accelerate's loaders claim the class: see below
        raise TypeError(
            f"threads= loads a torch.utils.data.DataLoader's batches with threads; got "
            f"{type(source).__qualname__}: pass the DataLoader itself, or leave threads out"
        )
    loader = kind.loader
    # What threads can never load is refused before what a changed argument would fix, so
    # that following the first message reaches a working setting (a stateful loader with
    # num_workers=2 must not be told to drop its workers, only to be refused next).
    why = ""
    if kind.datapipe:
        why = (
            "its dataset is a datapipe, which torch's own iterator seeds and shards per worker "
            "in a way threads would bypass"
        )
    elif kind.client is Client.ACCELERATE and not kind.map_style:
        why = (
            "accelerate's loader over an IterableDataset splits it between ranks inside its own "
            "iteration, which threads would bypass"
        )
    elif kind.client is Client.ACCELERATE:
        # Else its DataLoader is loaded inside accelerate's.
        base = classify(getattr(loader, "base_dataloader", None))
        why = unthreadable_shard(loader, base.torch_iteration)
    elif not kind.torch_iteration:
        why = (
            f"{type(loader).__qualname__} iterates in its own way, which threads would bypass; "
            f"build a plain DataLoader"
        )
    if why:
        raise ValueError(
            f"threads= cannot load this DataLoader: {why}; or leave threads out (num_workers= "
            "loads in processes)"
        )
    if loader.num_workers > 0:
        trainer = _UNDER_TRAINER if kind.client is Client.ACCELERATE else ""
        raise ValueError(
            f"threads= loads in place of the DataLoader's worker processes, and this one was "
            f"built with num_workers={loader.num_workers}: build it with num_workers=0 (the "
            f"threads do its loading{trainer}), or leave threads out to keep the processes"
        )
    if loader.worker_init_fn is not None and not is_trainer_seed_worker(loader.worker_init_fn):
        _warn_uncalled(loader.worker_init_fn, threads)
    return threads


def warn_unseeded_threads(loader: Any, threads: int, seen: object) -> None:
    """At an epoch's start under ``threads=``: worker seeding the threads do not do.

    ``seen``: the ``worker_init_fn`` the loader had at ``prefetch()`` (warned of there). One set
    since (Lightning's Trainer gives the loader its own through the prefetcher) is not called
    either; nor is the one Lightning Fabric's ``setup_dataloaders`` would give (the threads
    load the plain loader): ``seed_everything(workers=True)`` exports ``PL_SEED_WORKERS=1``.
    """
    init = loader.worker_init_fn
    if init is not None and init is not seen and not is_trainer_seed_worker(init):
        _warn_uncalled(init, threads)
    elif init is None and os.environ.get("PL_SEED_WORKERS") == "1":
        warn(
            f"nostall.prefetch(threads={threads}): seed_everything(workers=True) is on "
            f"(PL_SEED_WORKERS=1), and a loader Lightning sets up (Fabric's "
            f"setup_dataloaders, the Trainer) reseeds each worker process; loading threads "
            f"are not reseeded so: what your dataset draws differs from such a loader with "
            f"num_workers={threads}. Pass workers=False to seed_everything (nothing changes "
            f"where Lightning sets up none of your loaders), or leave threads out",
            UserWarning,
        )


def warn_unpinned(loader: Any) -> None:
    """At an epoch's start under ``threads=``: ``pin_memory=True`` with no accelerator.

    The loader's own iterator warns so when it starts; loading threads replace that iterator,
    so they say it in its words (batches are not pinned: see ``pinning_like``).
    """
    if loader.pin_memory and not torch.accelerator.is_available():
        warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device "
            "pinned memory won't be used.",
            UserWarning,
        )


def _warn_uncalled(init: object, threads: int) -> None:
    warn(
        f"nostall.prefetch(threads={threads}): this DataLoader's worker_init_fn "
        f"({getattr(init, '__qualname__', init)!r}) is not "
        f"called: loading threads are not worker processes, and they share one dataset "
        f"object. If it opens a file or seeds a generator per worker, do that on first use in "
        f"each thread instead (threading.local(), get_worker_info().id), or draw from "
        f"torch.thread_safe_generator(); leave threads out to keep worker processes",
        UserWarning,
    )
