"""What consecutive passes of one Prefetcher hand on to each other.

A :class:`Lineage` holds the consumer's position (:class:`~nostall._epochs.resume.Position`: the
epoch, the batches of it handed out, what resuming there needs), the producer that runs ahead
into the next epoch, the batches a stopped pass of a one-shot source fetched and nobody took,
and the latest producer thread (two must never pull from one source).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from .._epochs.epochs import EpochSource
from .._epochs.resume import Position
from .._sources.samplers import readable_epoch
from .._warn import warn
from .channel import BATCH, Channel
from .latest_producer import LatestProducer
from .overlap import Overlap
from .producer import Puller


class Iteration(Protocol):
    """What the lineage asks of the pass it holds (a ``PrefetchIterator``)."""

    held_ahead: Callable[[], int]

    @property
    def running(self) -> bool: ...

    @property
    def depth(self) -> int: ...

    def _finish_if_complete(self) -> None: ...

    def _stop(self, why: str) -> None: ...


class Lineage:
    """What consecutive iterations of one Prefetcher share and hand on to each other.

    Holds no reference to the Prefetcher (only weak ones to its iterations), so that a
    finaliser can use it after the Prefetcher is gone. Its fields are its own: the prefetcher
    and the iterations tell it what happened through its verbs (a batch handed out, an epoch
    ended or complete, a state loaded, an epoch set, a producer started, closed).

    Invariants:
        * ``at`` only moves when the user receives something (a batch, one batch's error, an
          epoch's end, or a new ``iter()`` after all ``len(source)`` batches), sets an epoch,
          or loads a state: never when a batch is fetched ahead.
        * At most one producer pulls from the source: a new one starts after the latest
          (``thread``) ended, or is the one ``ahead`` itself.
        * A one-shot source's batches fetched by a stopped pass and not handed out are handed
          out by the next pass, before anything new is pulled.
    """

    def __init__(self, epochs: EpochSource, transform_state: Any) -> None:
        self.epochs = epochs
        self._at = Position.start(0, transform_state)
        #: The latest producer thread: one pulls from the source at a time.
        self.producer = LatestProducer(epochs)
        #: A one-shot source's latest puller: what it fetched and nobody took is carried over.
        self._carried: Puller | None = None
        #: Across epochs, the puller already fetching ``epoch`` between iterations.
        self._ahead: Puller | None = None
        self._exhausted = False  # a one-shot source has ended
        #: The depth the latest pass used when it ended (grown, with ``depth="auto"``).
        self._last_depth: int | None = None
        self._active: weakref.ref[Iteration] | None = None
        self._owner_alive = True
        #: A transform state loaded, to set when the next producer starts (not before: the
        #: previous producer may still be transforming a batch).
        self._pending_transform_state: Any = None
        #: Multi-rank run seen at the first epoch (warned once when the loader is unsharded).
        #: Whether the passes pull ahead or inline: judged across them, on the consumer's pace.
        self.overlap = Overlap()

    @property
    def at(self) -> Position:
        """Where the consumer is, and what a state saved now holds."""
        return self._at

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration yields."""
        return self._at.epoch

    @property
    def last_depth(self) -> int | None:
        """The depth the latest pass ended with (None before any ended)."""
        return self._last_depth

    @property
    def exhausted(self) -> bool:
        """A one-shot source has ended: it yields nothing more."""
        return self._exhausted

    def active_iteration(self) -> Iteration | None:
        """The latest iteration, while it exists (a ``PrefetchIterator``), else None."""
        return self._active() if self._active is not None else None

    def began(self, iteration: Iteration) -> None:
        """``iter()`` made ``iteration``, the latest."""
        self._active = weakref.ref(iteration)

    def first_epoch(self) -> bool:
        """Whether the first pass is starting: no pass has ended or stopped yet.

        (A first pass whose start raised is still the first when it is started again.)
        """
        return self._last_depth is None

    def ahead_in(self, epoch: int) -> bool:
        """Whether a producer already runs ahead in ``epoch`` (the next iteration's)."""
        return self._ahead is not None and epoch == self.epoch

    def take_ahead(self) -> Puller | None:
        """The puller already fetching this epoch, if its order is still the sampler's.

        One opened for an epoch the sampler is no longer in is stopped (see
        :meth:`opened_with_current_epoch`).
        """
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.stopped:
            return None
        if self.opened_with_current_epoch(ahead):
            return ahead
        ahead.stop()  # its order was drawn for an epoch the sampler is no longer in
        return None

    def take_pending_transform_state(self) -> Any:
        """The transform state loaded for the next producer to set (once), or None."""
        state, self._pending_transform_state = self._pending_transform_state, None
        return state

    def pass_ended(self, depth: int) -> None:
        """A pass ended or stopped with its channel at ``depth`` (kept for the next)."""
        self._last_depth = depth

    def advanced(self, epoch: int, index: int, state: Any, transform_state: Any) -> None:
        """The ``index``-th batch of ``epoch`` reached the user (or failed in the hand-out)."""
        self._at.advance(epoch, index, state, transform_state)

    def handed_out(
        self, epoch: int, index: int, state: Any, transform_state: Any, hook: Any
    ) -> None:
        """A batch was handed out: the position moves, and its pull's effects are replayed."""
        at = self._at  # Position.advance written out: this runs for every batch
        at.epoch, at.handed_out, at.source_state, at.loaded = epoch, index, state, None
        if transform_state is not None:
            at.transform_state = transform_state
        if self.epochs.mirror is not None:  # EpochSource.hand_out, without its call otherwise
            self.epochs.hand_out(hook, end=False)

    def error_handed_out(self, epoch: int, index: int, state: Any) -> None:
        """One batch's error was handed out: counted, and a generator it ended is exhausted.

        A generator that raised is closed: it can yield nothing more. The next pass then says
        so, as for a generator that ended normally, instead of yielding nothing silently. A
        one-shot source of another kind may go on after its error (the next pass pulls on).
        """
        self._at.advance(epoch, index, state, None)
        source = self.epochs.source
        if (
            self.epochs.kind.one_shot
            and inspect.isgenerator(source)
            and inspect.getgeneratorstate(source) == inspect.GEN_CLOSED
        ):
            self._exhausted = True

    def end_handed_out(self, puller: Puller, epoch: int, state: Any, hook: Any) -> None:
        """``epoch``'s end was handed out: the next epoch begins, perhaps already fetched.

        Across epochs the next epoch's ``set_epoch`` is called here, in the consumer's thread
        (unless the producer already opened it ahead): a ``set_epoch`` the user makes after
        this comes after nostall's.
        """
        epochs = self.epochs
        epochs.hand_out(hook, end=True)
        self._at = self._at.after(epoch + 1, 0, state)
        follow = epochs.across_epochs and not puller.finished
        forward = lambda: epochs.forward_epoch(epoch + 1, counted=True)  # noqa: E731
        puller.took_end(epoch, forward if follow else None)
        epochs.ended_here(puller.marks.get(epoch))
        epochs.note_marks()
        if epochs.kind.one_shot:
            self._exhausted = True
        if follow:
            self._ahead = puller  # it is already fetching the next epoch
            if not self._owner_alive:
                self.discard_ahead(wait=False)

    def epoch_complete(self, epoch: int) -> None:
        """``epoch`` counts complete: its ``len()`` batches were handed out, its end not asked."""
        self._at = self._at.after(epoch + 1, 0, self.epochs.complete_state(epoch))

    def loaded(self, at: Position, state: dict[str, Any], transform: bool) -> None:
        """A checked state was loaded: the position is ``at``, the next epoch opens from it.

        What runs ahead is dropped; the transform's state (``transform``: the state holds one
        and there is a transform) is set when the next producer starts.
        """
        self.discard_ahead()
        self._at = at
        self.epochs.load(state)
        self.epochs.note_marks()  # as the state left them: not set by someone else
        if transform:
            self._pending_transform_state = at.transform_state

    def switch_source(self, source: Any, timeout: float | None) -> None:
        """From the next epoch on, read ``source`` (a sharded copy) at the current epoch.

        What was opened ahead is dropped, and the previous producer, which may still be inside
        the old source's ``__next__``, is waited for: nothing reads the source it replaces.
        """
        self.discard_ahead()
        self.producer.wait_ended(timeout)
        epochs = self.epochs
        epochs.use_source(source)
        epochs.forward_epoch(self.epoch)
        epochs.note_marks()  # set by nostall: not an outside set_epoch
        self._at = self._at.moved_to(self.epoch, keep_source_state=False, keep_loaded=False)

    def move_to_epoch(self, epoch: int, who: str) -> None:
        """The epoch was set to ``epoch`` by ``who``: the position moves there.

        ``who`` is the user's ``set_epoch``, or someone else setting the sampler's epoch.

        A state loaded for another epoch is dropped, with a warning at the user's line; the
        position of this epoch, once begun, stands (nothing about the order changed).
        """
        resume, dropped = self.epochs.resume, False
        if resume is not None and resume["epoch"] != epoch:
            warn(
                f"nostall: {who} after load_state_dict() of a state for epoch "
                f"{resume['epoch']}: the loaded state is dropped",
                UserWarning,
            )
            self.epochs.drop_resume()
            dropped = True
        at = self._at
        # Another epoch, or this one not begun: a state saved now must hold what was done to
        # the sampler, which only a fresh start state reads.
        begun = at.epoch == epoch and at.handed_out > 0 and at.loaded is None
        self._at = at.moved_to(epoch, keep_source_state=begun, keep_loaded=not dropped)

    def follow_outside_set_epoch(self) -> bool:
        """Before a fresh epoch opens: adopt an epoch set on the sampler by someone else.

        Returns whether someone else set it: an outside ``set_epoch`` (Lightning calls it on
        ``loader.sampler``) wins over nostall's own count, and the prefetcher's epoch count
        follows it where the sampler shows its epoch.
        """
        if not self.epochs.marks_moved():
            return False
        outside = readable_epoch(self.epochs.source)
        if outside is not None and outside != self.epoch:
            self.move_to_epoch(outside, f"the sampler was set to epoch {outside}")
        return True

    def opened_with_current_epoch(self, ahead: Puller) -> bool:
        """Whether the epoch a producer opened ahead still matches the sampler's epoch.

        Between the end of one epoch and the start of the next, a framework may call
        ``set_epoch`` on the sampler itself. Valid only if the sampler's marks are still those
        nostall left when it called ``set_epoch`` for this epoch, and the order was drawn with
        them (or is not drawn yet, and so will be).
        """
        with ahead.pull_lock:  # not while the producer is inside the source
            current = self.epochs.marks()
            if current != self.epochs.left_marks:
                return False
            drawn = ahead.marks.get(self.epoch)
            return drawn is None or drawn == current

    def carry(self, puller: Puller) -> None:
        """A new pass starts with ``puller``; a one-shot source's is carried over.

        What it fetched and nobody took goes to the next pass (see :meth:`carry_over`).
        """
        self._carried = puller if self.epochs.kind.one_shot else None

    def carry_over(self, channel: Channel) -> bool:
        """Move batches a stopped pass of a one-shot source fetched and nobody took to ``channel``.

        Returns True when the carried messages include the end of the source or its error, so
        that no producer is needed.
        """
        previous, self._carried = self._carried, None
        if previous is None:
            return False
        for message in previous.channel.drain():
            channel.put_ready(message)  # never more than depth: the old channel held as many
            if message[0] is not BATCH:
                return True
        return False

    def discard_ahead(self, wait: bool = True) -> None:
        """Stop a producer that runs ahead into the next epoch; what it fetched is dropped.

        With ``wait``, return only once it can no longer touch the source (a pull under way,
        which may be opening an epoch and calling ``set_epoch``, has finished), so that the
        caller may change the source's epoch or state itself.
        """
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.stop()
            if wait:
                ahead.wait_idle()

    def close(self) -> None:
        """The Prefetcher was closed: stop the latest pass and its producer thread.

        Waits a while for a producer inside the source's ``__next__`` (see
        :meth:`LatestProducer.join_at_close`).
        """
        active = self.active_iteration()
        if active is not None:
            active._stop("the Prefetcher was closed")
        self._active = None
        self.discard_ahead()
        self.producer.join_at_close()
        self._carried = None
        self.epochs.worker_record.release()  # a loop over the loader itself gets its batches

    @staticmethod
    def owner_gone(lineage: Lineage) -> None:
        """The Prefetcher was collected: nobody can start another iteration."""
        lineage._owner_alive = False
        active = lineage.active_iteration()
        if active is None or not active.running:
            lineage.discard_ahead(wait=False)  # a finaliser must not block
            lineage.epochs.worker_record.release()
