"""What nostall tells users about the source they pass, before and while it runs.

Refusals (with the fix) for what cannot run ahead in a background thread, and warnings where a
framework cannot see the loader behind a prefetcher, where the next epoch cannot be seamless, or
where a resume cannot be exact. Nothing here changes what is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from .._clients.accelerate import accelerate_is_active
from .._warn import warn
from .samplers import has_unreadable_set_epoch, left_as_counted, unmark
from .sharding import distributed_world, is_sharded, unsharded_warning
from .sources import Client, SourceKind
from .webdataset import shuffle_warning, unreplayable_shuffles
from .worker_draws import draws_in_workers


def describe(source: object) -> str:
    """The source's type, as messages name it."""
    return type(source).__qualname__


def refuse_unsupported(kind: SourceKind, across_epochs: bool) -> None:
    """Refuse, with the fix, what nostall cannot run ahead of in a distributed run."""
    if kind.accelerate_dispatcher and distributed_world() is not None:
        raise ValueError(
            "nostall.prefetch cannot run ahead of an accelerate DataLoaderDispatcher in a "
            "distributed run: each of its batches is a collective call across ranks, which "
            "must not run in a background thread. Prepare the loader with "
            "DataLoaderConfiguration(dispatch_batches=False) (each rank then reads its own "
            "shard), or iterate the dispatcher without nostall"
        )
    if kind.accelerate_shard and across_epochs and distributed_world() is not None:
        raise ValueError(
            "across_epochs=True over an accelerate-prepared loader in a distributed run: "
            "opening its next epoch synchronises random states across ranks (a collective "
            "call), which must not run in nostall's background thread; pass "
            "across_epochs=False"
        )


def warn_about_epochs(source: object, kind: SourceKind) -> None:
    """With ``across_epochs``: say where the next epoch cannot be as seamless as promised."""
    if kind.restarts_workers:
        warn(
            "nostall: across_epochs=True over a DataLoader with workers but without "
            "persistent_workers=True: the next epoch's first batches are fetched early, but "
            "each epoch still starts new worker processes (and copies the dataset into "
            "them). Pass persistent_workers=True to the DataLoader to keep them.",
            UserWarning,
        )
    if has_unreadable_set_epoch(source):
        warn(
            f"nostall: across_epochs=True, and set_epoch reaches an object of "
            f"{describe(source)} that keeps no readable 'epoch' attribute, so nostall "
            f"cannot notice set_epoch calls made on it directly (as Lightning makes on "
            f"loader.sampler). Call set_epoch on the prefetcher, or give that object an "
            f"'epoch' attribute that its set_epoch sets",
            UserWarning,
        )


def warn_if_hidden_from_framework(source: object, kind: SourceKind, shard: bool | None) -> None:
    """At the first epoch: warn where a framework cannot see the loader behind the prefetcher."""
    if shard is None:
        world = distributed_world()
        if world is not None and kind.dataloader_type and not is_sharded(source):
            warn(unsharded_warning(source, *world), UserWarning)
    if accelerate_is_active() and kind.dataloader_type and kind.client is not Client.ACCELERATE:
        warn(
            "nostall: an accelerate Accelerator is active, but the DataLoader given to "
            "nostall.prefetch was not prepared by it, so accelerate neither shards it nor "
            "places its batches, and accelerator.accumulate() cannot see its epoch's end "
            "(accelerator.prepare() of a prefetcher sees no DataLoader). Call loader = "
            "accelerator.prepare(loader) first, then nostall.prefetch(loader); threads= loads "
            "a prepared loader too (built with num_workers=0)",
            UserWarning,
        )


def warn_inexact_resume(
    source: object,
    kind: SourceKind,
    epoch: int,
    handed_out: int,
    stateful: bool,
    replay: dict[str, Any] | None = None,
    records_workers: bool = False,
) -> None:
    """At ``load_state_dict``: say where a resume cannot give the uninterrupted run's batches.

    ``epoch`` is resumed after ``handed_out`` of its batches. A webdataset shuffle that cannot
    be drawn again is named for what it is; it then stands for the general warning about a
    stateful loader's IterableDataset, which it explains. ``replay``: the state's record of
    the epoch's order (None for a stateful source); ``records_workers``: whether this
    source's workers' draws are recorded and resumed (see ``worker_draws``).
    """
    shuffles = unreplayable_shuffles(source, epoch, handed_out)
    if shuffles:
        warn(
            shuffle_warning(shuffles, epoch, handed_out),
            UserWarning,
        )
    if stateful:
        warn_inexact_stateful_resume(source, kind, iterable_dataset=not shuffles)
    if replay is not None:
        warn_unresumed_worker_draws(kind, replay, records_workers)


def warn_unresumed_worker_draws(
    kind: SourceKind, replay: dict[str, Any], records_workers: bool
) -> None:
    """Say where random numbers drawn in the loader's worker processes are not resumed.

    Persistent workers (the loader's own, or the one a wrapper iterates) carry their draws
    from every earlier epoch of the run, which a resumed run's new workers did not make:
    only an epoch whose workers started with it (``fresh_iterator``) is loaded again from its
    start as it was. Said only where the dataset's first sample, tried here, draws (or the
    trial cannot tell: see ``draws_in_workers``), and where the state holds no record of the
    workers' draws that this loader takes. A record that this loader cannot take (another
    ``num_workers``) is named too.
    """
    persistent = kind.loader if kind.persistent else kind.held_persistent
    recorded = replay.get("worker_draws") or (replay.get("end_of") or {}).get("worker_draws")
    resumable = (
        records_workers and recorded is not None and len(recorded["states"]) == (kind.workers)
    )
    if persistent is not None and not replay.get("fresh_iterator", True) and not resumable:
        if draws_in_workers(persistent) is False:
            return  # its first sample draws nothing: nothing to resume
        warn(
            "nostall: this loader keeps its worker processes across epochs "
            "(persistent_workers=True), and the random numbers its dataset or collate_fn "
            "draws there (augmentations) follow from every batch those workers loaded since "
            "the run began, which this run's new workers did not load: the batches after "
            "this state hold the same samples in the same order, with other random values "
            "wherever the workers draw. For the values of an uninterrupted run, build the "
            "loader with persistent_workers=False (timm: create_loader(..., "
            "persistent_workers=False)); nostall then resumes its workers' draws",
            UserWarning,
        )
        return
    if recorded is None:
        return
    saved, here = len(recorded["states"]), kind.workers
    if not records_workers or saved != here:
        warn(
            f"nostall: this state recorded the random numbers drawn in {saved} worker "
            f"processes, but this loader has num_workers={here}"
            f"{', persistent' if kind.persistent else ''}: the batches after the state "
            f"hold the same samples in the same order, with other random values wherever "
            f"the workers draw. For the values of an uninterrupted run, build the loader as "
            f"it was saved (num_workers={saved}, persistent_workers=False)",
            UserWarning,
        )


def warn_inexact_stateful_resume(
    source: object, kind: SourceKind, iterable_dataset: bool = True
) -> None:
    """Say where a source's own ``state_dict`` cannot resume exactly (torchdata's loader)."""
    generator = getattr(source, "generator", None)
    if isinstance(generator, torch.Generator):
        warn(
            "nostall: this loader resumes through its own state_dict(), which does not hold "
            "the state of its generator=: the following epochs draw other orders than an "
            "uninterrupted run (and a loader that draws from it when built, as accelerate's "
            "does, may resume this epoch differently too). Save "
            "loader.generator.get_state() at each epoch's start with your checkpoint and "
            "restore it before the next epoch, or use a plain DataLoader (nostall then "
            "replays its generator)",
            UserWarning,
        )
    dataset = getattr(source, "dataset", None)
    if (
        iterable_dataset
        and kind.loader is not None
        and not kind.map_style
        and not callable(getattr(dataset, "state_dict", None))
    ):
        warn(
            f"nostall: this loader resumes its {type(dataset).__qualname__} (an "
            f"IterableDataset without state_dict) by iterating it again and skipping what was "
            f"seen, which is exact only if the dataset yields the same order again; one that "
            f"shuffles from the global random state does not. Give the dataset "
            f"state_dict()/load_state_dict()",
            UserWarning,
        )


def warn_drawn_ahead(kind: SourceKind) -> None:
    """An epoch opened ahead, in the producer thread, drew from torch's global generator.

    A DataLoader draws its workers' base seed at every ``iter()`` from its ``generator=``, or
    from torch's global generator without one, and a ``RandomSampler`` without a generator of
    its own draws its order there too. A plain loop draws them at its ``iter()``; opened ahead
    (``across_epochs=True``) they are drawn at a moment that depends on the threads. So does
    a wrapper that iterates a DataLoader it holds (timm's ``PrefetchLoader``), at its first
    pull.
    """
    loader = kind.inner if kind.inner is not None else kind.held
    if loader is None:
        return
    persistent = kind.persistent if kind.inner is not None else kind.held_persistent is not None
    samplers = (loader.sampler, getattr(loader.batch_sampler, "sampler", None))
    # torch's random samplers (RandomSampler, SubsetRandomSampler, WeightedRandomSampler) keep
    # a ``generator``: None draws from torch's. A persistent loader draws its base seed once.
    unseeded = [s for s in samplers if s is not None and getattr(s, "generator", 0) is None]
    if (loader.generator is not None or persistent) and not unseeded:
        return
    # What drew: a sampler with a seed of its own (a DistributedSampler's) draws nothing
    # there; the DataLoader's base seed (its workers' seeds, drawn with or without workers)
    # is drawn from torch's generator unless the DataLoader has a generator= of its own.
    drew = " and ".join(
        (["its order"] if unseeded else [])
        + (["its base seed (for its workers' seeds)"] if loader.generator is None else [])
    )
    warn(
        f"nostall: across_epochs=True opened this epoch ahead, in its background thread, and "
        f"{describe(kind.source)} drew {drew} from torch's "
        f"global generator there, at a moment that depends on the threads: what your loop "
        f"draws from that generator around the epoch's end (dropout, augmentations, the code "
        f"after the last epoch) no longer matches a plain loop. Pass "
        f"generator=torch.Generator().manual_seed(seed) to the DataLoader (and to a "
        f"RandomSampler you build) to keep its draws apart",
        UserWarning,
    )


class SameEpochWatch:
    """Warns once when a shuffling ``DistributedSampler`` drew two epochs at one epoch number.

    Its order is drawn from its seed and its ``epoch`` alone: where nobody calls ``set_epoch``
    between epochs, every epoch repeats the first one's order, with or without nostall (a
    plain ``DataLoader`` does the same, silently).

    Invariants:
        * Only epochs that ran to their end are compared (a batch peeked before training, or
          an epoch broken off, is not one), each by the sampler's epoch marks as its order
          was drawn (:meth:`ended`: after a ``set_epoch`` made lazily at the first ``next()``
          of a framework's loader, too). ``load_state_dict`` forgets them (:meth:`reset`).
        * The warning is raised as the next epoch opens, once it is under way (:meth:`opened`):
          raised as an error, it loses no batch and no epoch's end.
        * Not where nostall counts the epochs itself (``across_epochs=True``).
    """

    def __init__(self) -> None:
        self._last: object = None
        self._due: tuple[str, int] | None = None
        self._warned = False

    def ended(self, kind: SourceKind, across_epochs: bool, marks: object) -> None:
        """An epoch's end was handed out; ``marks``: the epoch marks its order was drawn with."""
        if self._warned or across_epochs or kind.loader is None:
            return
        sampler = kind.loader.sampler
        if isinstance(kind.loader.batch_sampler, BatchSampler):
            # Not every BatchSampler subclass keeps a .sampler (accelerate's shards do not).
            sampler = getattr(kind.loader.batch_sampler, "sampler", sampler)
        if not isinstance(sampler, DistributedSampler) or not sampler.shuffle:
            return
        if not isinstance(marks, tuple):  # not drawn, or its marks moved while it was drawn
            self._last = None
            return
        if marks == self._last:
            self._due = (describe(kind.source), sampler.epoch)
        self._last = marks

    def reset(self) -> None:
        """A state was loaded: the epochs before it are not this run's to compare."""
        self._last, self._due = None, None

    def opened(self) -> None:
        """An epoch opened and is under way: say what the last two ended epochs showed."""
        if self._due is None or self._warned:
            return
        (source, epoch), self._due, self._warned = self._due, None, True
        warn(
            f"nostall: the DistributedSampler of {source} drew the last two epochs' orders at "
            f"the same epoch ({epoch}): set_epoch() was not called between them, so they "
            f"shuffled in the same order, and so will this one (a plain DataLoader would too). "
            f"Call prefetcher.set_epoch(epoch) (or loader.sampler.set_epoch(epoch)) before "
            f"each epoch",
            UserWarning,
        )


class UnaskedEpochWatch:
    """Warns once where ``across_epochs=True`` sets a sampler's epoch that the loop never sets.

    Across epochs nostall calls ``set_epoch`` itself for each next epoch. While this watch
    decides, an epoch nostall moved the sampler to is marked (``samplers.Counted``). A loop that
    sets the epoch (``prefetcher.set_epoch``, or ``sampler.set_epoch`` directly, as Lightning,
    an Ignite handler and most loops do) leaves a plain int there, and gets the orders it asks
    for. A loop that never does (an Ignite ``Engine`` without its ``set_epoch`` handler) would,
    without nostall, repeat one epoch's order: with nostall each epoch has a new order, which
    is said once, as the loop starts the first epoch whose epoch nostall set alone.

    Invariants:
        * Decided at the first epoch a pass opens after the first pass, once that epoch is
          open (its ``set_epoch`` made) and before anything of it is taken: raised as an
          error, the warning loses nothing, and is not raised again.
        * Once decided, nothing is marked any more, and the mark left is made a plain int
          again: a sampler's ``epoch`` is a ``Counted`` only around the first epoch boundary
          (``torch.load(weights_only=True)`` refuses one saved in a checkpoint).
        * ``prefetcher.set_epoch`` decides at once: the loop sets the epoch.
    """

    def __init__(self) -> None:
        self._decided = False

    @property
    def deciding(self) -> bool:
        """Whether nostall's own ``set_epoch`` calls are still marked (see the class)."""
        return not self._decided

    def loop_sets(self, kind: SourceKind) -> None:
        """The loop set the epoch itself (``prefetcher.set_epoch``)."""
        self._decide(kind)

    def opened(self, kind: SourceKind, epoch: int) -> None:
        """A pass after the first opened ``epoch`` of a prefetcher counting epochs."""
        if self._decided:
            return
        if kind.client is not Client.PLAIN:
            # Fabric's and accelerate's loaders set the epoch themselves, from their own
            # count, at their iteration's start (which across epochs the producer may not
            # have reached yet): the loop's framework asks.
            self._decide(kind)
            return
        target = left_as_counted(kind.source)
        self._decide(kind)
        if target is None or epoch < 1:
            return  # the loop set it after nostall did, or nostall moved nothing
        if isinstance(target, DistributedSampler) and not target.shuffle:
            return  # its order does not depend on the epoch
        warn(
            f"nostall: across_epochs=True calls set_epoch itself for each next epoch, and "
            f"your loop never set the epoch of {describe(kind.source)}'s "
            f"{type(target).__qualname__}: this epoch ({epoch}) is shuffled by its epoch "
            f"number, where the same loop without nostall would repeat the order of the epoch "
            f"it was left at. If new orders are what you want, call "
            f"prefetcher.set_epoch(epoch) at each epoch's start (with Ignite, the set_epoch "
            f"handler, e.g. setup_common_training_handlers(trainer, train_sampler=sampler)), "
            f"which also silences this; to keep the loop's orders, pass across_epochs=False",
            UserWarning,
        )

    def _decide(self, kind: SourceKind) -> None:
        self._decided = True
        unmark(kind.source)
