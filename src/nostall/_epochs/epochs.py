"""Opening a source's epochs: ``set_epoch``, the random state an order is drawn from, resuming.

A source's epoch order is fixed when its iterator is created (and, for a ``RandomSampler``
without a generator, at its first batch). To resume mid-epoch on a fresh, identically built
source, nostall either asks the source for its own state (``state_dict`` /
``load_state_dict``, as torchdata's ``StatefulDataLoader`` has) or records what the order was
drawn from (the random generators' states and the sampler's epoch) and draws it again, then
skips the batches already handed out: through the sampler without loading them where the source
is a map-style ``DataLoader`` (or Lightning Fabric's loader over one), else by pulling and
dropping them.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._clients.accelerate import ShardMirror
from .._clients.fabric import IterCount
from .._loading.pacing import Pacer
from .._loading.pool import Pool
from .._loading.threadable import warn_unpinned, warn_unseeded_threads
from .._loading.threaded_stream import ThreadedStream
from .._loading.threads import ThreadedEpoch
from .._sources.checks import SameEpochWatch, UnaskedEpochWatch
from .._sources.generators import HandBack, Saved, set_states
from .._sources.global_draws import DrawWatch
from .._sources.samplers import capture_rng, epoch_marks, forward_set_epoch, sampler_epoch_of
from .._sources.sources import Client, classify, open_epoch
from .._sources.worker_draws import (
    PersistentResume,
    Restore,
    WorkerRecord,
    restored_states,
)
from .._torch_compat import live_iterator
from .drawn_orders import DrawnOrders
from .skip import TakenAhead, drop, nothing, skip_ahead, skip_once


class _Start(enum.Enum):
    AS_BUILT = "as built"


#: ``Position.source_state`` before any batch of the epoch was handed out since the source was
#: built, its epoch set, or a state loaded: the source is read when the state is saved (see
#: :mod:`nostall._epochs.resume`).
AS_BUILT = _Start.AS_BUILT


class EpochSource:
    """Opens epochs of one source for one Prefetcher, in whichever thread pulls next.

    Invariants:
        * With ``across_epochs``, ``set_epoch(e)`` reaches the source before epoch e's iterator
          is created, so its order is the one ``set_epoch(e)`` gives in a plain loop.
        * A loaded state (``resume``) is used by the first epoch opened with its number, then
          dropped.
        * What each epoch's order was drawn from is recorded by ``orders``
          (:class:`~nostall._epochs.drawn_orders.DrawnOrders`), before the order is drawn.
    """

    def __init__(
        self,
        source: Iterable[Any],
        across_epochs: bool,
        threads: int | None = None,
        context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        *,
        transform: bool = False,
        timeout: float | None = None,
        ahead: int = 64,
    ) -> None:
        #: What the source is, and the source itself (:mod:`nostall._sources.sources`).
        self.kind = classify(source)
        #: Whether the source draws from the global generators; pulled in step while it may.
        self.draws = DrawWatch(self.kind, threads=threads, transform=transform, timeout=timeout)
        #: Whether a shuffling DistributedSampler is left at one epoch (see :meth:`opened_here`).
        self.same_epoch = SameEpochWatch()
        #: Whether nostall counts epochs on a sampler that the loop never sets (across epochs).
        self.unasked = UnaskedEpochWatch()
        #: With ``threads=``: the loading threads every epoch of the DataLoader runs on, each
        #: task inside ``context()`` (on CUDA: the prefetcher's device and source stream).
        self.pool = None if threads is None else Pool(threads, "nostall-load", context)
        #: Paces the pulls of loading threads, over every epoch (see
        #: :mod:`nostall._loading.pacing`).
        self.pacer = None if threads is None else Pacer()
        #: Batches a threaded epoch may start ahead: the current channel's free slots.
        self.room: Callable[[], int] = lambda: 0
        self.across_epochs = across_epochs
        #: The loader's ``worker_init_fn`` as given (see :func:`warn_unseeded_threads`).
        self.worker_init = getattr(self.kind.inner, "worker_init_fn", None)
        #: With accelerate: iterate the prepared loader's shadow, replay its effects at hand-out.
        mirror = self.mirror = ShardMirror(source) if self.kind.mirrored else None
        if mirror is not None and self.pool is not None:
            pool, draws = self.pool, self.draws  # the shard's DataLoader, inside its iteration
            mirror.load_with(
                lambda loader: ThreadedEpoch(
                    loader,
                    pool,
                    lambda: 0 if draws.in_step else self.room(),
                    inline=lambda: draws.in_step,  # as _iterate: draws in the loop's order
                    trial=draws.trial,
                )
            )
        #: The source resumes through its own ``state_dict()`` (torchdata's loader; over
        #: accelerate, a prepared stateful loader), not by drawing its order again.
        self.stateful = mirror.stateful if mirror is not None else self.kind.stateful
        #: Over Fabric's loader: its count of iter() calls, which sets the sampler's epoch.
        self.count = IterCount(source) if self.kind.client is Client.FABRIC else None
        #: What each epoch's order was drawn from, and how the next one's is drawn.
        self.orders = DrawnOrders(self.count)
        self.resume: dict[str, Any] | None = None
        #: The draws of the loader's worker processes, per round of batches pulled (see
        #: :mod:`nostall._sources.worker_draws`), kept as far back as the producer runs ahead.
        self.worker_record = WorkerRecord(ahead)
        #: The sampler's epoch marks (:meth:`marks`) as nostall last left or saw them; marks
        #: that differ at the next epoch's start were set by someone else.
        self.left_marks = self.marks()

    def load(self, state: dict[str, Any]) -> None:
        """A checked state was loaded: its epoch is resumed by the next epoch opened.

        A state at an epoch's start draws that epoch's order as the sampler's epoch recorded
        for it says, as if ``set_epoch`` had been called with it now: a loop (or framework)
        that iterates after ``load_state_dict`` without calling ``set_epoch`` gets the order
        the uninterrupted run drew, and one that calls it still decides.
        """
        self.resume = state
        self.orders.forget_follow()
        replay = None if self.stateful else state["replay"]
        if replay is None or state["batches_yielded"]:
            return
        if replay.get("sampler_epoch") is not None:
            forward_set_epoch(self.iterable, replay["sampler_epoch"])
        if self.count is not None:
            self.count.restore(replay)

    def drop_resume(self) -> None:
        """The loaded state no longer applies (another epoch was set): open epochs afresh."""
        self.resume = None

    def use_source(self, source: Iterable[Any]) -> None:
        """From the next epoch on, open ``source`` (a sharded copy of the same kind)."""
        self.kind = classify(source)

    def records_workers(self) -> bool:
        """Whether the draws of the source's worker processes are recorded, and resumed."""
        return self.pool is None and self.mirror is None and self.kind.records_worker_draws

    def _iterate(
        self,
        loader: Any,
        skipped: int = 0,
        restored: tuple[bytes | None, ...] | None = None,
        *,
        epoch: int,
    ) -> Iterator[Any]:
        """Epoch ``epoch``'s iterator: the loader's own, or the threads' (by index, or as workers).

        Over a loader whose workers' draws are recorded, its batches pass through the record
        (``restored``: the states the resumed workers start at).
        """
        if self.pool is None or self.mirror is not None:
            kind = classify(loader) if self.mirror is None else None
            if kind is not None and kind.records_worker_draws:
                if kind.persistent:
                    return self.worker_record.iterate_persistent(loader, open_epoch, epoch)
                return self.worker_record.iterate(loader, open_epoch, epoch, skipped, restored)
            return open_epoch(loader)
        draws = self.draws
        warn_unseeded_threads(loader, self.pool.size, self.worker_init)
        warn_unpinned(loader)
        if not self.kind.map_style:
            return ThreadedStream(loader, self.pool, inline=lambda: draws.in_step)
        return ThreadedEpoch(
            loader,
            self.pool,
            lambda: 0 if draws.in_step else self.room(),
            skipped,
            inline=lambda: draws.in_step,  # its samples' draws in order, in the pulling thread
            trial=draws.trial,  # or fetched by the threads, then judged, while not known
        )

    @property
    def source(self) -> Iterable[Any]:
        """The source (a sharded copy from the epoch :meth:`use_source` set it on)."""
        return self.kind.source  # type: ignore[no-any-return]

    @property
    def iterable(self) -> Iterable[Any]:
        """What is iterated for each epoch: the source, or its accelerate shadow."""
        return self.source if self.mirror is None else self.mirror.shadow

    def forward_epoch(self, epoch: int, *, counted: bool = False) -> None:
        """Call ``set_epoch(epoch)`` where the source keeps it (see :func:`forward_set_epoch`).

        ``counted``: across epochs, by nostall's own count: marked so (``Counted``) while
        :attr:`unasked` has not decided whether the loop sets the epoch itself.
        """
        forward_set_epoch(self.iterable, epoch, counted=counted and self.unasked.deciding)

    def length(self) -> int | None:
        """Batches per epoch (``len(source)``), or None for a source without a length."""
        return self.kind.length()

    def counted_length(self) -> int | None:
        """``len(source)`` where it counts the batches an epoch yields; None where it estimates.

        An epoch of a source whose ``len()`` is an estimate (see ``SourceKind.counted``) is
        complete once its end was seen, not once ``len()`` batches were.
        """
        return self.length() if self.kind.counted else None

    def stream_readers(self) -> int | None:
        """How many workers split a stream's items (its batches take theirs in turn).

        The loading threads (``threads=``), else the DataLoader's own worker processes (one
        reader without any); None for a map-style source or one that is no DataLoader,
        whose order does not depend on who loads it. A stream resumed with another count
        would skip other batches than the ones handed out: a state records it.
        """
        loader = self.kind.loader
        if loader is None or self.kind.map_style:
            return None
        if self.pool is not None and self.mirror is None:
            return self.pool.size
        return max(1, loader.num_workers)

    def marks(self) -> tuple[tuple[str, int], ...]:
        """See :func:`epoch_marks`."""
        return epoch_marks(self.source)

    def opened_here(self) -> None:
        """The consumer opened an epoch: say what the epochs before it showed, if anything.

        Called once the epoch is under way (its marks noted, its producer started): the
        warning it may raise, made an error, loses nothing.
        """
        self.same_epoch.opened()

    def ended_here(self, marks: object) -> None:
        """The consumer took an epoch's end; ``marks``: its order's epoch marks (or STALE)."""
        self.same_epoch.ended(self.kind, self.across_epochs, marks)

    def note_marks(self) -> None:
        """nostall set (or saw) the sampler's epoch: its marks now are not someone else's."""
        self.left_marks = self.marks()

    def marks_moved(self) -> bool:
        """Whether someone else set the sampler's epoch since :meth:`note_marks` (noted now)."""
        now = self.marks()
        if now == self.left_marks:
            return False
        self.left_marks = now
        return True

    def independent_epochs(self) -> bool:
        """Whether an epoch may start while a thread is stuck in the previous one's source.

        Only where no thread of this process that nostall started is inside the user's code
        with the stuck one's state: under ``threads=`` (the stuck sample's thread is let go,
        new ones load, and the dataset is one that threads may share), or a DataLoader with
        worker processes and no persistent ones (the stuck sample is in a worker process the
        old iterator owns; the new epoch starts new workers, as a DataLoader does after a
        timeout). With ``num_workers=0`` the stuck call is the dataset's own, in nostall's
        thread, and running another epoch beside it could share state it was not built to
        share.
        """
        if self.pool is not None:
            return True
        return self.mirror is None and self.kind.restarts_workers

    def after_pull(self, end: bool) -> Any:
        """What the consumer must replay when this pull is handed out (accelerate), or None."""
        return None if self.mirror is None else self.mirror.after_pull(end)

    def hand_out(self, hook: Any, end: bool) -> None:
        """The consumer hands out a pull (a batch, or the end): replay its ``after_pull`` hook.

        Over accelerate's prepared loader, its shard then shows what it would at this point of
        a plain loop (see ``ShardMirror``); over any other source, nothing.
        """
        if self.mirror is not None:
            self.mirror.hand_out(hook, end=end)

    def let_go_of_loading(self, stuck_for: float) -> None:
        """Under ``threads=``: the loading threads stuck ``stuck_for`` s are counted no more.

        New samples start new threads (see ``Pool.abandon``); threads busy for less time end
        their sample as usual.
        """
        if self.pool is not None:
            self.pool.abandon(running_for=stuck_for)

    def before_open(self) -> None:
        """The consumer is about to open an epoch (accelerate: the shadow takes the shard's)."""
        if self.mirror is not None:
            self.mirror.sync_epoch()

    def complete_state(self, epoch: int) -> Any:
        """The state after ``epoch``, counted complete at ``len()`` batches, its end not asked.

        A stateful source states itself (as built); over accelerate, the shard's epoch is left
        as a ``break`` leaves it.
        """
        if self.mirror is not None:
            self.mirror.abandon()  # accelerate's own iterator would not have ended either
        return AS_BUILT if self.stateful else self.end_state(epoch)

    def open(
        self, epoch: int, forward: bool | None = None, outside: bool = False
    ) -> tuple[Iterator[Any], int]:
        """Create the source's iterator for ``epoch``; return it and the batches it skipped.

        A loaded state for this epoch is resumed: the source restores its own state, or the
        order is drawn again from the recorded random state and the batches already handed
        out are skipped. ``forward``: call the source's ``set_epoch(epoch)`` first (default:
        across epochs, where nostall counts the epochs itself). ``outside``: the epoch was set
        on the sampler by someone else (a framework that takes ``len()`` batches).
        """
        resume, self.resume = self.resume, None
        if resume is not None and resume["epoch"] != epoch:
            resume = None
        end_of = None if resume is None or self.stateful else resume["replay"].get("end_of")
        if end_of and not outside and resume is not None:
            self._ask_for_the_end(epoch - 1, end_of)
            # Then as a state saved at this epoch's start: its order drawn from torch's
            # generator as recorded, the source's own generators as the replayed end left them.
            replay = resume["replay"]
            resume = {**resume, "replay": {**replay, "rng": {"torch": replay["rng"]["torch"]}}}
        if self.across_epochs if forward is None else forward:
            forward_set_epoch(self.iterable, epoch, counted=self.unasked.deciding)
        skipped = 0 if resume is None else resume["batches_yielded"]
        if self.stateful:
            if resume is not None and resume["source_state"] is not None:
                self.source.load_state_dict(resume["source_state"])  # type: ignore[attr-defined]
            return self._iterate(self.iterable, epoch=epoch), skipped
        if resume is None:
            self.orders.opened(epoch, self.source)
            return self._iterate(self.iterable, epoch=epoch), 0
        replay = resume["replay"]
        if replay["sampler_epoch"] is not None:
            forward_set_epoch(self.iterable, replay["sampler_epoch"])
        batches, drew = self._replay(epoch, replay, skipped)
        follows = replay.get("next_rng")
        if skipped and drew and follows is not None:
            self.orders.follow(epoch + 1, follows)
        return batches, skipped

    def _ask_for_the_end(self, epoch: int, end_of: dict[str, Any]) -> None:
        """Replay a complete epoch whose end was not asked for yet, and ask for it.

        A state saved after an epoch's last batch but before its ``StopIteration`` is resumed
        at the next epoch's start. A loop that goes on by itself would have asked for that end
        first, and asking has effects (a ``RandomSampler`` draws once more from the loader's
        generator), so it is asked for again here; a framework that sets the next epoch on the
        sampler itself never asks, and gets the state as saved (``outside`` in :meth:`open`).
        """
        before = sampler_epoch_of(self.source)
        if end_of["sampler_epoch"] is not None:
            forward_set_epoch(self.iterable, end_of["sampler_epoch"])
        user = Saved()  # asking drew before the state was saved: the user's generators back
        list(self._replay(epoch, end_of, end_of["batches"])[0])  # all skipped: the end is left
        user.put_back()
        if before is not None:
            forward_set_epoch(self.iterable, before)  # as set for the epoch opening now

    def _replay(
        self, epoch: int, replay: dict[str, Any], skipped: int
    ) -> tuple[Iterator[Any], bool]:
        """Draw the epoch's order again from ``rng`` and skip the first ``skipped`` batches.

        Returns it and whether the order drew from torch's generator. The order and skipped
        batches draw from ``rng``, as before the state was saved; the batches after them from
        the global generators as the user's loop (its checkpoint) has them, as uninterrupted.
        """
        rng = replay["rng"]
        back, drew = HandBack(rng["torch"]), False  # back(): once the order and skips drew
        source_draws, pull_draws = replay.get("source_draws"), replay.get("pull_draws")

        def last_pull() -> None:
            """The last skipped batch pulled draws as its pull did (resume.with_source_draws)."""
            if pull_draws is not None:
                set_states(pull_draws)

        def given_back() -> None:
            """The user's generators back; a prefetched source's as after the state's batch."""
            back()
            if source_draws is not None:
                set_states(source_draws)  # see resume.with_source_draws

        if self.count is not None:
            self.count.restore(replay)
        self.orders.opened(epoch, self.source, rng, fresh_iterator=replay["fresh_iterator"])
        try:
            fresh = live_iterator(self.source) is None
            started = given_back if skipped else nothing
            resumed = self._resumed_persistent(replay, started)
            if resumed is not None and not fresh:
                # This prefetcher's own workers drew past the state: new ones, at its states.
                fresh = self.worker_record.forget_workers(self.source)  # type: ignore[arg-type]
                resumed = resumed if fresh else None
            if resumed is not None:
                # Its workers start as recorded, its sampler skips to their round's start.
                it = self.worker_record.iterate_persistent(
                    self.source,  # type: ignore[arg-type]
                    open_epoch,
                    epoch,
                    resumed,
                )
                drop(it, skipped - resumed.start)
            elif self.kind.persistent and not replay["fresh_iterator"] and fresh:
                # A fresh persistent loader's first iter() also draws its workers' base seed
                # (uninterrupted: in an earlier epoch): create it, then reset it with a second
                # iter() to draw the order again (once it exists, one iter() resets it).
                iter(self.source)
                self.orders.restore(self.source, rng)
                it = open_epoch(self.source)
                for _ in itertools.islice(it, skipped):
                    pass
                if skipped:
                    given_back()
            else:
                held = self.kind.held_persistent
                if (
                    held is not None
                    and not replay["fresh_iterator"]
                    and live_iterator(held) is None
                ):
                    # The same for the persistent loader a wrapper iterates (timm's
                    # PrefetchLoader): start its workers, then the wrapper's iter() resets it.
                    iter(held)
                    self.orders.restore(self.source, rng)
                it = skip_ahead(
                    self.iterable,
                    skipped,
                    lambda loader, skipped: self._iterate(loader, skipped, epoch=epoch),
                    given_back,
                    last_pull,
                    self._resumed_workers(replay, skipped, epoch),
                )
            # Pull the first batch now: a sampler may draw its order lazily at its first item
            # (where batches were skipped, the skip gave the generators back right after it).
            # A batch that raises raises at its next(), as uninterrupted: not taken for the
            # epoch's opening failing, which would end the epoch and lose what follows it.
            error: Exception | None = None
            try:
                first = list(itertools.islice(it, 1))
            except Exception as e:
                first, error = [], e
            drew = back.drew if skipped else not torch.equal(torch.get_rng_state(), rng["torch"])
            return TakenAhead(first, it, error), drew
        finally:
            if skipped:
                back()
            elif not drew:
                # At an epoch's start the order drew after the state was saved: left there. Else
                # the user's (the state's may be older: an epoch's end is recorded as pulled).
                torch.set_rng_state(back.before.torch)

    def _resumed_workers(
        self, replay: dict[str, Any], skipped: int, epoch: int
    ) -> tuple[int, Callable[[Any, int], Iterator[Any]], Callable[[Any], Any]] | None:
        """How a resume starts the workers where the state recorded them, or None.

        ``(start, iterate, restore)``: the sampler skips ``start`` batches (the recorded
        round's start), ``restore(loader)`` gives the copy that skips them workers that start
        at the recorded states, and ``iterate`` opens it with the record continued from them.
        """
        recorded = replay.get("worker_draws")
        if not skipped or recorded is None or not self.records_workers() or self.kind.persistent:
            return None
        states = recorded["states"]
        if len(states) != self.source.num_workers:  # type: ignore[attr-defined]
            return None  # warned at load_state_dict
        restored = restored_states(states)

        def iterate(loader: Any, start: int) -> Iterator[Any]:
            return self._iterate(loader, start, restored, epoch=epoch)

        def restore(loader: Any) -> Any:
            loader.worker_init_fn = Restore(loader.worker_init_fn, states)
            return loader

        return recorded["batches"], iterate, restore

    def _resumed_persistent(
        self, replay: dict[str, Any], started: Callable[[], None]
    ) -> PersistentResume | None:
        """How a fresh persistent loader's workers start where the state recorded them, or None.

        ``started``: called once the skipped batches' indices were drawn (see ``skip_ahead``).
        """
        recorded = replay.get("worker_draws")
        if recorded is None or not self.kind.persistent or not self.records_workers():
            return None
        loader: Any = self.source
        states = recorded["states"]
        if len(states) != loader.num_workers:
            return None  # warned at load_state_dict
        start = recorded["batches"]
        swaps: dict[str, Any] = {
            "worker_init_fn": Restore(loader.worker_init_fn, states),
            "batch_sampler": skip_once(loader.batch_sampler, start, started),
        }
        if not replay["fresh_iterator"]:
            swaps["generator"] = torch.Generator()  # the base seed, drawn in an earlier epoch
        return PersistentResume(start, restored_states(states), swaps)

    def state_per_batch(self, epoch: int) -> tuple[Callable[[], Any] | None, Any]:
        """How the state after each batch of ``epoch`` is had, decided once ``epoch`` is open.

        ``(ask, None)``: asked of a stateful source after each batch; ``(None, record)``:
        the same record for every batch (what the order was drawn from, recorded as the epoch
        opened and not changed until a later epoch opens): :meth:`batch_state`, without a
        call per batch.
        """
        if self.stateful:
            return self.iterable.state_dict, None  # type: ignore[attr-defined]
        return None, self.orders.drawn(epoch)

    def batch_state(self, epoch: int) -> Any:
        """What a state saved right after this batch needs (called where the batch was pulled)."""
        if self.stateful:
            return self.iterable.state_dict()  # type: ignore[attr-defined]
        return self.orders.drawn(epoch)

    def end_state(self, epoch: int, drawn: Any = None) -> Any:
        """What a state saved at the end of ``epoch`` needs, to draw the next epoch's order.

        ``drawn`` is what ``epoch``'s order was drawn from (default: as recorded when it was
        opened). The next epoch's sampler epoch is ``epoch + 1`` where the sampler was at
        ``epoch`` (someone sets it each epoch: the user, a framework, ``across_epochs``),
        else the one it stays at; over Fabric's loader, its next ``iter()`` count.
        """
        if self.stateful:
            return self.iterable.state_dict()  # type: ignore[attr-defined]
        if drawn is None:
            drawn = self.orders.drawn(epoch)
        state: dict[str, Any] = {
            "rng": {**capture_rng(self.source), "torch": self.orders.next_draws_from(epoch)},
            "sampler_epoch": None,
            "fresh_iterator": False,
        }
        if isinstance(drawn, dict) and drawn.get("sampler_epoch") is not None:
            sampler_epoch = drawn["sampler_epoch"]
            state["sampler_epoch"] = epoch + 1 if sampler_epoch == epoch else sampler_epoch
        if self.count is not None:
            state.update(self.count.after(drawn, sampler_epoch_of(self.source)))
        return state

    def next_epoch(self, epoch: int) -> dict[str, Any]:
        """What a state saved inside ``epoch`` records of how the next epoch's order is drawn.

        Only across epochs, where the producer may draw it ahead, and once nothing is pulled
        in step with the loop (a source that draws is pulled in step, so its next epoch is
        drawn only when the loop asks for it, after the state was saved).
        """
        draws = self.draws
        if self.stateful or not self.across_epochs or (draws.in_step and not draws.was_apart):
            return {}  # (once prefetched, the next epoch may have been opened ahead)
        return {"next_rng": self.orders.next_draws_from(epoch)}

    def start_state(self) -> Any:
        """What a state saved before an epoch's first batch needs.

        A stateful source is asked for its state (nothing was pulled from it, so it is where
        the user is). Otherwise the random state, and the sampler's epoch as ``set_epoch`` left
        it, so that a resumed run draws the order of the epoch that was set.
        """
        if self.stateful:
            return self.iterable.state_dict()  # type: ignore[attr-defined]
        return self.orders.capture(self.source)
