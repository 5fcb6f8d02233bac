"""The device prefetcher: batches fetched, pinned and copied in the background."""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar, cast

from . import _arguments as check
from ._device import DeviceLike, resolve_data_device
from ._engine.autodepth import most_in_flight
from ._engine.iteration import REPLACED, PrefetchIterator
from ._engine.lineage import Lineage
from ._engine.profile import StallRecorder, StallReport
from ._engine.settings import Settings
from ._epochs.epochs import EpochSource
from ._epochs.resume import (
    loaded_position,
    state_of,
    uncounts,
    with_source_draws,
    with_worker_draws,
)
from ._exceptions import PrefetcherClosedError, ProfilingDisabledError
from ._loader_attributes import LoaderAttributes
from ._sources.checks import (
    describe,
    refuse_unsupported,
    warn_about_epochs,
    warn_inexact_resume,
)
from ._sources.samplers import forward_set_epoch as _forward_set_epoch
from ._sources.sharding import sharded_copy
from ._staging.base import Staging
from ._staging.choose import staging_for
from ._warn import warn

T = TypeVar("T")


def prefetch(
    source: Iterable[T],
    device: DeviceLike = None,
    *,
    depth: int | Literal["auto"] = 2,
    pin_memory: bool | None = None,
    timeout: float | None = None,
    across_epochs: bool = False,
    profile: bool = False,
    transform: Callable[[Any], Any] | None = None,
    shard: bool | None = None,
    threads: int | None = None,
) -> Prefetcher[T]:
    """Wrap ``source`` so that its next batches are loaded and moved to ``device`` meanwhile.

    ``for batch in nostall.prefetch(loader): ...`` yields the same batches as ``loader``, in the
    same order, already on the device. See :class:`Prefetcher` for every guarantee.

    Args:
        source: any iterable of batches, usually a ``torch.utils.data.DataLoader``.
        device: where batches go; ``None`` picks Fabric's device for a loader from
            ``fabric.setup_dataloaders``, else the current CUDA device when CUDA is available
            (under ``torchrun``, ``LOCAL_RANK`` while that is still ``cuda:0``), else the CPU.
        depth: how many batches may be fetched ahead of the consumer (an int >= 1), or
            ``"auto"``: start at 1 and double whenever the consumer finds nothing ready, up to
            what :data:`nostall._engine.autodepth.MEMORY_SHARE` of the device's free memory holds.
        pin_memory: pin host tensors before copying them to a GPU (default: on for CUDA).
        timeout: seconds to wait for one batch before raising ``PrefetchTimeoutError``.
        across_epochs: keep fetching into the next epoch when one ends (calling the source's
            ``set_epoch``), so that no epoch starts with an empty pipeline.
        profile: record how long each ``next()`` waits; read it with ``report()``.
        transform: applied to each batch after it reached the device (on CUDA on the copy
            stream, before the consumer's stream waits), e.g. ``nostall.transforms.Normalize``.
        shard: in a ``torch.distributed`` run of several ranks, give each rank its own part of
            a DataLoader whose sampler is not distributed, with a ``DistributedSampler`` built
            as Lightning builds the one it injects (``True``); never split, never warn
            (``False``); or warn that every rank loads all the data (``None``, the default).
        threads: load a ``DataLoader``'s samples with this many threads in this process,
            instead of worker processes: the loader's dataset, sampler and ``collate_fn``, the
            same batches in the same order (see :mod:`nostall._loading.threads`). The loader must be
            built with ``num_workers=0``; over a map-style dataset its ``__getitem__`` must be
            safe to call from several threads at once (``nostall doctor`` checks it); over an
            ``IterableDataset`` the threads read it as N worker processes would
            (:mod:`nostall._loading.threaded_stream`).
    """
    return Prefetcher(
        source,
        device,
        depth=depth,
        pin_memory=pin_memory,
        timeout=timeout,
        across_epochs=across_epochs,
        profile=profile,
        transform=transform,
        shard=shard,
        threads=threads,
    )


def _skipping(prefetcher: Prefetcher[T], skip: Callable[[Any], Iterable[T]]) -> Prefetcher[T]:
    """A prefetcher made as ``prefetcher`` was, over ``skip(its source)``.

    accelerate's ``skip_first_batches`` returns it when given a prefetcher (see
    :func:`nostall._clients.accelerate.route_skip_first_batches`). The skipping loader is the
    rest of one epoch and shares the source's sampler, so it never runs ahead into another
    epoch; it reports to the same profile. Its source is sharded already.
    """
    settings = prefetcher._settings
    kept = {field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)}
    kept.update(across_epochs=False, shard=None if settings.shard is None else False)
    skipping = Prefetcher(skip(prefetcher.source), **kept)
    skipping._recorder = prefetcher._recorder
    return skipping


class Prefetcher(LoaderAttributes, Generic[T]):
    """An iterable over ``source``'s batches, fetched ahead in a thread and moved to ``device``.

    Concurrency invariants:
        * Each ``iter()`` makes one iteration: one epoch. It takes nothing from the source until
          its first ``next()``, which creates the source's iterator in the calling thread and
          starts one producer thread, named ``nostall-prefetch-N``.
        * At most ``depth`` batches have been pulled from the source and not yet handed out.
        * At most one thread pulls from the source at a time: a new ``iter()`` stops the
          previous iteration, and its first ``next()`` waits for the previous producer to end.
        * On CUDA, one copy stream per prefetcher; each batch is handed out only after the
          consumer's current stream waits on the batch's copy event, and its tensors are
          ``record_stream``-ed on that stream (see :class:`~nostall._staging.cuda.CudaStaging`).
        * An error in the source or in the transfer reaches the consumer after every batch
          before it, as the same exception object with a note of where it happened.
        * The producer holds no reference to the prefetcher or the iteration: dropping the
          iteration (``break``, ``del``, garbage collection) stops its thread within
          ``POLL_S`` seconds, or as soon as the source's ``__next__`` returns.

    Epochs: the prefetcher counts them (:attr:`epoch`, from 0 or the last :meth:`set_epoch`),
    and follows an epoch set on the sampler directly (Lightning's way), read from its ``epoch``
    attribute before the next epoch starts. A source with a length is never asked past its
    ``len()`` batches before the consumer asks; a new ``iter()`` after all of them counts the
    epoch complete. With ``across_epochs=True`` the next epoch is opened (``set_epoch(e + 1)``,
    its order drawn) when the consumer takes the end of epoch e, or, once the consumer has shown
    that it asks for each end, as soon as the producer reaches it, still within ``depth``; the
    next ``iter()`` continues from there unless the sampler's epoch changed meanwhile.
    ``set_epoch(k)`` for the epoch already started ahead changes nothing; any other ``k``
    discards what was fetched ahead. An error in one batch does not end the epoch.

    State: :meth:`state_dict` counts batches handed to the user, never batches fetched ahead;
    :meth:`load_state_dict` on a fresh prefetcher over an identically built source resumes
    exactly there (see :mod:`nostall._epochs.epochs`).

    Lifecycle: open until :meth:`close` (idempotent; also on leaving a ``with`` block); iterating
    a closed prefetcher raises :class:`~nostall.PrefetcherClosedError`.

    Attributes not defined here (``dataset``, ``sampler``, ``batch_size``, ...) are read from the
    source; ``len()`` is the source's length.
    """

    def __init__(
        self,
        source: Iterable[T],
        device: DeviceLike = None,
        *,
        depth: int | Literal["auto"] = 2,
        pin_memory: bool | None = None,
        timeout: float | None = None,
        across_epochs: bool = False,
        profile: bool = False,
        transform: Callable[[Any], Any] | None = None,
        shard: bool | None = None,
        threads: int | None = None,
    ) -> None:
        # The clients are asked here and in __iter__ and state_dict only (see
        # tests/test_architecture.py): the facade imports none at import time.
        from ._clients.accelerate import route_skip_first_batches
        from ._clients.fabric import fabric_device

        self._settings = Settings.checked(
            source,
            device=device,
            depth=depth,
            pin_memory=pin_memory,
            timeout=timeout,
            across_epochs=across_epochs,
            profile=profile,
            transform=transform,
            shard=shard,
            threads=threads,
        )
        self._source = source
        self.device = resolve_data_device(fabric_device(source) if device is None else device)
        self._pin_memory = (pin_memory is not False) if self.device.type == "cuda" else False
        self._staging: Staging = staging_for(self.device, self._pin_memory, transform)
        epochs = EpochSource(
            source,
            across_epochs,
            threads,
            self._staging.source_context,
            transform=transform is not None,
            timeout=timeout,
            ahead=_ahead(depth),
        )
        refuse_unsupported(epochs.kind, across_epochs)
        self._lineage = Lineage(epochs, self._staging.transform_state())
        self._recorder = StallRecorder(self.device) if profile else None
        self._closed = False
        # Across epochs the producer outlives each iteration; once nobody can start the next
        # one, stop it (the finaliser holds the lineage only, never the prefetcher).
        weakref.finalize(self, Lineage.owner_gone, self._lineage)
        if across_epochs:
            warn_about_epochs(source, epochs.kind)
        route_skip_first_batches(Prefetcher, _skipping)

    @property
    def depth(self) -> int | Literal["auto"]:
        """How many batches may be fetched ahead, as passed (see :attr:`current_depth`).

        Set, it applies from the next ``iter()``.
        """
        return self._settings.depth

    @depth.setter
    def depth(self, depth: int | Literal["auto"]) -> None:
        check.depth(depth)
        self._settings = self._settings.replace(depth=depth)
        self._lineage.epochs.worker_record.look_ahead(_ahead(depth))

    @property
    def across_epochs(self) -> bool:
        """Whether the next epoch is fetched while one ends, as passed."""
        return self._settings.across_epochs

    @property
    def source(self) -> Iterable[T]:
        """The wrapped iterable (with ``shard=True`` in a distributed run: its sharded copy)."""
        self._resolve_shard()
        return self._source

    def _resolve_shard(self) -> None:
        """With ``shard=True``, switch to a sharded copy once ``torch.distributed`` is up.

        Lazy, because frameworks initialise the process group after the prefetcher is built
        (Lightning in ``Trainer.fit``), and a loop may run an epoch before it does (a sanity
        pass, with no world to split for: it loads everything). Checked again at each epoch's
        start (``iter()``, ``set_epoch``) and wherever the loader is read (``len()``,
        ``.sampler``), so every epoch that opens once the group is up is sharded; done at most
        once. Never while an epoch is under way: one started, or resumed from a state loaded
        for the whole loader, ends as it began. An epoch opened ahead (``across_epochs``) and
        not yet handed out is dropped, as a ``set_epoch`` drops it.

        After the switch the copy's sampler is at the prefetcher's :attr:`epoch` (as
        ``set_epoch`` would have left it), and a state saved before the next epoch's first
        batch describes the copy.
        """
        settings = self.__dict__.get("_settings")
        if settings is None or not settings.shard:
            return
        lineage = self._lineage
        active = lineage.active_iteration()
        if (active is not None and active.running) or lineage.epochs.resume is not None:
            return
        sharded = sharded_copy(self._source)
        if sharded is None:
            return
        lineage.switch_source(sharded, self._settings.timeout)
        object.__setattr__(self, "_source", sharded)

    def _source_attribute_set(self) -> None:
        self._lineage.discard_ahead()  # an epoch opened ahead with the old value is dropped

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def current_depth(self) -> int:
        """Batches the current (else the latest) iteration may fetch ahead.

        ``depth`` itself, or with ``depth="auto"`` what it grew to so far: 1 at each epoch's
        start (or where the last epoch left it, with ``across_epochs``), doubled whenever the
        loop found nothing ready, up to what the device's memory budget holds.
        """
        active = self._lineage.active_iteration()
        if active is not None:
            return active.depth
        if self._lineage.last_depth is not None:
            return self._lineage.last_depth
        return 1 if self.depth == "auto" else int(self.depth)

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (or the one in progress)."""
        return self._lineage.epoch

    def __iter__(self) -> PrefetchIterator[T]:
        """Start a new iteration (lazily: nothing is fetched until its first ``next()``).

        A ``PrefetchIterator``; under Ignite's ``DeterministicEngine`` resuming mid-epoch, see
        :meth:`_for_deterministic_engine`.
        """
        from ._clients.ignite import engine_skips
        from ._clients.lightning import held_ahead, iterating_fetcher

        if self._closed:
            raise PrefetcherClosedError(
                "this Prefetcher was closed; create a new one with nostall.prefetch(source) to "
                "iterate again"
            )
        self._lineage.producer.check_not_forked()
        lineage = self._lineage
        previous = lineage.active_iteration()
        if previous is not None:
            previous._finish_if_complete()
            previous._stop(REPLACED)
        self._resolve_shard()  # once the previous epoch ended: never mid-epoch
        # Lightning's loop over a loader without a length fetches one batch ahead of its step.
        fetcher = iterating_fetcher()
        iteration: PrefetchIterator[T] = PrefetchIterator.of(
            self, lambda: held_ahead(fetcher) if fetcher is not None else 0
        )
        lineage.began(iteration)
        skips = engine_skips(sys._getframe(1))
        if skips:
            return self._for_deterministic_engine(iteration, skips)
        return iteration

    def _for_deterministic_engine(
        self, iteration: PrefetchIterator[T], skips: int
    ) -> PrefetchIterator[T]:
        """``iteration`` for Ignite's ``DeterministicEngine``, which drops ``skips`` batches.

        Where the loaded state already resumes after those batches, the engine is handed
        ``skips`` placeholders (None) to drop first, and the position is unchanged; else a
        warning says that the resumed epoch is not the uninterrupted one (see
        :mod:`nostall._clients.ignite`).
        """
        from ._clients.ignite import AfterPlaceholders, skip_unloaded

        loaded = self._lineage.at.loaded
        resumes = None if loaded is None else loaded["batches_yielded"]
        if resumes == skips:
            return cast("PrefetchIterator[T]", AfterPlaceholders(iteration, skips))
        warn(skip_unloaded(skips, resumes))
        return iteration

    def report(self, *, all_ranks: bool = False) -> StallReport:
        """How long the loop waited for batches so far (needs ``profile=True``).

        With ``all_ranks=True`` every rank's figures are gathered through ``torch.distributed``
        (a collective call: every rank must make it) and the slowest rank is named.
        """
        if self._recorder is None:
            raise ProfilingDisabledError(
                "report() needs a profiling prefetcher: pass profile=True to nostall.prefetch"
            )
        return self._recorder.report(all_ranks=all_ranks)

    def set_epoch(self, epoch: int) -> None:
        """Start counting from ``epoch`` and forward ``set_epoch(epoch)`` to the source.

        It reaches the first of these that has ``set_epoch``: the source, its ``sampler``, its
        ``batch_sampler``, the ``batch_sampler``'s ``sampler``, its ``dataset`` (nothing happens
        when none has it). Call it before iterating: the order is drawn when the iteration's
        first ``next()`` creates the source's iterator. With ``across_epochs``, calling it for
        the epoch already started ahead is a no-op; any other epoch discards what was fetched
        ahead.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise TypeError(f"set_epoch(epoch) takes an int >= 0 ({check.received(epoch)})")
        if epoch < 0:
            raise ValueError(f"set_epoch(epoch) takes an int >= 0 (got epoch={epoch})")
        lineage = self._lineage
        lineage.epochs.unasked.loop_sets(lineage.epochs.kind)
        if lineage.ahead_in(epoch):
            return  # the producer already started this epoch, with set_epoch(epoch)
        lineage.discard_ahead()
        lineage.move_to_epoch(epoch, f"set_epoch({epoch})")
        self._resolve_shard()
        _forward_set_epoch(self._source, epoch)
        lineage.epochs.note_marks()

    def state_dict(self) -> dict[str, Any]:
        """Where the user is: the epoch and the batches of it already handed out.

        Batches fetched ahead are not counted, nor those Lightning's loop took ahead of its
        step (over a loader without a length, see :mod:`nostall._clients.lightning`; where they
        cannot be left out, it warns). Save it with your checkpoint; give it to
        :meth:`load_state_dict` of a fresh prefetcher over an identically built source.
        """
        from ._clients.lightning import warn_counted_ahead

        self._resolve_shard()  # the next epoch's source, once it is sharded
        lineage = self._lineage
        active = lineage.active_iteration()
        held = 0 if active is None else active.held_ahead()
        if held and lineage.at.loaded is None and not uncounts(lineage.at, lineage.epochs):
            warn_counted_ahead(describe(self._source), held, lineage.epochs.stateful)
        state = state_of(lineage.at, lineage.epochs, held)
        if lineage.epochs.draws.drew and lineage.at.loaded is None:
            with_source_draws(state, lineage.epochs.draws)  # a source that draws
        if lineage.at.loaded is None:
            with_worker_draws(state, lineage.epochs)  # its workers' draws, where recorded
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state``: the next iteration yields the rest of its epoch.

        Raises:
            ValueError: the state is not one nostall wrote, or does not fit this source
                (another length, another sampler, another kind of loader).
        """
        if self._closed:
            raise PrefetcherClosedError("this Prefetcher was closed; it cannot load a state")
        lineage = self._lineage
        self._resolve_shard()
        at = loaded_position(state, lineage.epochs, self._staging.transform, lineage.at)
        epochs = lineage.epochs
        warn_inexact_resume(
            self._source,
            epochs.kind,
            at.epoch,
            at.handed_out,
            epochs.stateful,
            None if epochs.stateful else state["replay"],
            epochs.records_workers(),
        )
        active = lineage.active_iteration()
        if active is not None:
            active._stop("load_state_dict() was called on the Prefetcher")
        transform = state.get("transform") is not None and self._staging.transform is not None
        lineage.loaded(at, state, transform)  # checked by loaded_position
        epochs.same_epoch.reset()  # the epochs before this state are not this run's

    def close(self) -> None:
        """Stop the current iteration and its producer thread; idempotent.

        Waits up to ``_lineage.CLOSE_JOIN_S`` seconds for a producer that is inside the source's
        ``__next__`` (not at all while the interpreter is finalising).
        """
        if self._closed:
            return
        self._closed = True
        self._lineage.close()

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"Prefetcher(source={describe(self._source)}, device={str(self.device)!r}, "
            f"depth={self.depth}, {state})"
        )


def _ahead(depth: int | Literal["auto"]) -> int:
    """The most batches the producer pulls ahead of the loop with ``depth``.

    A few more than in flight: a batch taken ahead on a resume, Lightning's look-ahead.
    """
    return most_in_flight(depth) + 8
