"""What consecutive passes of one Prefetcher hand on to each other.

A :class:`Lineage` holds the consumer's position (:class:`~nostall._resume.Position`: the
epoch, the batches of it handed out, what resuming there needs), the producer that runs ahead
into the next epoch, the batches a stopped pass of a one-shot source fetched and nobody took,
and the latest producer thread (two must never pull from one source).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any, Protocol

from . import _exit, _producer_thread, _stacks
from ._channel import BATCH, POLL_S, Channel
from ._epochs import EpochSource
from ._exceptions import PrefetcherClosedError, PrefetchTimeoutError
from ._producer import Puller
from ._resume import Position
from ._warn import warn


class Iteration(Protocol):
    """What the lineage asks of the pass it holds (a ``PrefetchIterator``)."""

    @property
    def running(self) -> bool: ...

    @property
    def depth(self) -> int: ...

    def _finish_if_complete(self) -> None: ...

    def _stop(self, why: str) -> None: ...


class Lineage:
    """What consecutive iterations of one Prefetcher share and hand on to each other.

    Holds no reference to the Prefetcher (only weak ones to its iterations), so that a
    finaliser can use it after the Prefetcher is gone.

    Invariants:
        * ``at`` only moves when the user receives something (a batch, one batch's error, an
          epoch's end, or a new ``iter()`` after all ``len(source)`` batches), sets an epoch,
          or loads a state: never when a batch is fetched ahead.
        * At most one producer pulls from the source: a new one starts after ``thread`` ended,
          or is ``ahead`` itself.
    """

    def __init__(self, one_shot: bool, epochs: EpochSource, transform_state: Any) -> None:
        self.one_shot = one_shot  # the source is its own iterator (a generator, say)
        self.epochs = epochs
        #: Where the consumer is, and what a state saved now holds.
        self.at = Position.start(0, transform_state)
        self.thread: threading.Thread | None = None  # the latest producer
        #: A one-shot source's latest puller: what it fetched and nobody took is carried over.
        self.carried: Puller | None = None
        #: Across epochs, the puller already fetching ``epoch`` between iterations.
        self.ahead: Puller | None = None
        self.exhausted = False  # a one-shot source has ended
        #: The depth the latest pass used when it ended (grown, with ``depth="auto"``).
        self.last_depth: int | None = None
        self.active: weakref.ref[Iteration] | None = None
        self.owner_alive = True
        #: A transform state loaded, to set when the next producer starts (not before: the
        #: previous producer may still be transforming a batch).
        self.pending_transform_state: Any = None
        #: ``_producer_thread.fork_generation`` when built: producers do not survive fork().
        self.fork_generation = _producer_thread.fork_generation
        #: Multi-rank run seen at the first epoch (warned once when the loader is unsharded).
        self.checked_world = False
        #: A puller a ``timeout`` was raised on, with its (epoch, pulled) then and the timeout:
        #: stuck in the source while those have not moved (see :meth:`stuck_producer`).
        self.stuck: tuple[weakref.ref[Puller], tuple[int, int], float] | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) iteration yields."""
        return self.at.epoch

    def active_iteration(self) -> Iteration | None:
        """The latest iteration, while it exists (a ``PrefetchIterator``), else None."""
        return self.active() if self.active is not None else None

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
            self.epochs.resume, dropped = None, True
        at = self.at
        # Another epoch, or this one not begun: a state saved now must hold what was done to
        # the sampler, which only a fresh start state reads.
        begun = at.epoch == epoch and at.handed_out > 0 and at.loaded is None
        self.at = at.moved_to(epoch, keep_source_state=begun, keep_loaded=not dropped)

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

    def wait_for_previous_producer(self, timeout: float | None) -> None:
        """Return once the latest producer ended: two threads must never pull from one source.

        Except a producer a ``timeout`` was raised on (stuck in the source): it is let go
        (:meth:`let_go_of_stuck`), and, if it is still stuck after ``timeout`` and each epoch
        of the source is independent of the previous one, the new iteration starts without
        it, as a DataLoader starts new workers after a timeout (a warning says so).

        Raises:
            PrefetchTimeoutError: it is still inside ``next(source)`` after ``timeout`` s (the
                lineage is left as it was, so that the caller may try again).
        """
        previous = self.thread
        if previous is None:
            return
        stuck = self.let_go_of_stuck()
        waited = 0.0
        while previous.is_alive():
            if timeout is not None and waited >= timeout:
                where = _stacks.stuck_at(previous)
                at = f" ({where})" if str(where) else ""
                independent = self.epochs.independent_epochs()
                if stuck and independent:
                    warn(
                        f"nostall: the producer thread {previous.name!r} is still inside the "
                        f"previous epoch's source{at} after timeout={timeout} s; this epoch "
                        f"starts from a new iterator without it, as a DataLoader starts new "
                        f"workers after a timeout. That thread ends when the call returns, "
                        f"and what it loads is dropped",
                        RuntimeWarning,
                    )
                    self.thread = None
                    return
                if not stuck:
                    fix = "; raise timeout= if the source is slow but alive"
                else:  # stuck in the dataset's own code, in nostall's thread
                    fix = (
                        "; it runs the dataset's own code in nostall's thread, which cannot be "
                        "stopped, and another epoch beside it could share state it was not "
                        "built to share. To go on without a stuck sample at the next epoch, as "
                        "a DataLoader does, load with worker processes (DataLoader(num_workers="
                        "N), not persistent) or with nostall.prefetch(..., threads=N)"
                    )
                raise PrefetchTimeoutError(
                    f"the previous iteration's producer thread {previous.name!r} is still inside "
                    f"next(source){at} after timeout={timeout} s; a new iteration cannot start "
                    f"until it returns, since two threads must not pull from one source" + fix,
                    timeout=timeout,
                    phase="inside next(source) for the previous iteration",
                    thread=previous.name,
                )
            previous.join(POLL_S)
            waited += POLL_S

    def mark_stuck(self, puller: Puller, timeout: float) -> None:
        """A ``timeout`` was raised waiting on ``puller``'s producer: it may be stuck."""
        self.stuck = (weakref.ref(puller), (puller.epoch, puller.pulled), timeout)

    def stuck_producer(self) -> tuple[threading.Thread, float] | None:
        """The latest producer and the timeout, if a timeout marked it and it has not moved.

        Stuck: still alive, still inside ``next(source)``, at the batch it was at when the
        timeout was raised. One that went on since is not stuck (the mark is dropped).
        """
        mark, thread = self.stuck, self.thread
        if mark is None:
            return None
        ref, at, timeout = mark
        puller = ref()
        if (
            puller is None
            or thread is None
            or puller.channel.thread is not thread
            or not thread.is_alive()
            or (puller.epoch, puller.pulled) != at
            or not puller.phase.startswith("next(source)")
        ):
            self.stuck = None
            return None
        return thread, timeout

    def let_go_of_stuck(self) -> bool:
        """Whether the latest producer is stuck (see :meth:`stuck_producer`); if so, let it go.

        Where each epoch is independent of the last (``EpochSource.independent_epochs``), it
        is interrupted at its next Python step (a call stuck in C: when it returns), dropping
        what it loads, and loading threads stuck as long are counted no more. Elsewhere the
        stuck call is the dataset's own, and is left alone.
        """
        stuck = self.stuck_producer()
        if stuck is None:
            return False
        thread, timeout = stuck
        if self.epochs.independent_epochs():
            _exit.interrupt(thread)
            self.epochs.let_go_of_loading(timeout)
        return True

    def handed_out_error(self) -> None:
        """One batch's error was handed out: a generator it ended is exhausted, as at its end.

        A generator that raised is closed: it can yield nothing more. The next pass then says
        so, as for a generator that ended normally, instead of yielding nothing silently. A
        one-shot source of another kind may go on after its error (the next pass pulls on).
        """
        source = self.epochs.source
        if (
            self.one_shot
            and inspect.isgenerator(source)
            and inspect.getgeneratorstate(source) == inspect.GEN_CLOSED
        ):
            self.exhausted = True

    def source_ended(self) -> None:
        """The source's end was handed out: a one-shot source is exhausted."""
        if self.one_shot:
            self.exhausted = True

    def carry(self, puller: Puller) -> None:
        """A new pass starts with ``puller``; a one-shot source's is carried over.

        What it fetched and nobody took goes to the next pass (see :meth:`carry_over`).
        """
        self.carried = puller if self.one_shot else None

    def carry_over(self, channel: Channel) -> bool:
        """Move batches a stopped pass of a one-shot source fetched and nobody took to ``channel``.

        Returns True when the carried messages include the end of the source or its error, so
        that no producer is needed.
        """
        previous, self.carried = self.carried, None
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
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.stop()
            if wait:
                ahead.wait_idle()

    @staticmethod
    def owner_gone(lineage: Lineage) -> None:
        """The Prefetcher was collected: nobody can start another iteration."""
        lineage.owner_alive = False
        active = lineage.active_iteration()
        if active is None or not active.running:
            lineage.discard_ahead(wait=False)  # a finaliser must not block


def check_not_forked(lineage: Lineage) -> None:
    """Refuse to go on in a child process: the producer thread did not survive fork()."""
    if lineage.fork_generation != _producer_thread.fork_generation and lineage.thread is not None:
        raise PrefetcherClosedError(
            "this Prefetcher was started in the parent of this process, and its producer "
            "thread did not survive fork(): create the prefetcher (or call nostall.prefetch "
            "again) in the process that iterates it, or use the 'spawn' start method"
        )
