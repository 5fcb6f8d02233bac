"""The producer: a puller that takes batches from the source and stages them.

A :class:`Puller` owns everything about pulling: the epoch source, the source's iterator, the
staging, where each error happened, and the rollover from one epoch to the next. It sends what
it pulls into its :class:`~nostall._engine.channel.Channel`, from the producer thread
(:func:`nostall._engine.producer_thread.produce`) or, when the producer is idle and nothing is
queued, from the consumer's own thread.

The producer thread is given only a Puller; it holds no reference to the prefetcher or to the
iteration that started it, so dropping those is enough for the garbage collector to collect them
and stop the thread.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._epochs.epochs import EpochSource
from .._epochs.skip import TakenAhead
from .._exceptions import noted
from .._exit import ThreadLetGo
from .._stacks import stuck_at
from .._staging.base import Staged, Staging
from .._torch_compat import dead_workers_behind
from .channel import BATCH, END, ERROR, FAILED, POLL_S, Channel, Kind, Message

#: Marks of an order drawn while someone set the sampler's epoch: equal to no marks.
STALE: Any = object()

# The puller's per-batch phases, told apart by identity (see ``Puller.phase``).
_NEXT, _MOVING = "next(source)", "moving"


class Puller:
    """Pulls the source's batches in order, stages them, and sends them into ``channel``.

    Invariants:
        * Pulls are serialised by ``pull_lock``, and a pulled message is queued (or handed to
          the consumer that pulled it) before the lock is released. When nothing is queued and
          the producer is not pulling, the consumer may pull the next batch itself
          (:meth:`pull_here`): it would otherwise wait for the same work, and on a fast source
          this saves two thread switches per batch. Both rules together keep every batch once
          and in order.
        * Once ``finished``, nothing more is pulled. An error in one batch does not finish the
          puller, but nothing more is pulled until the consumer took that error and asks for
          the next batch (``paused_at``, cleared by :meth:`go_on`): then the same iterator is
          asked for the following one, as a DataLoader's iterator is when the loop catches the
          error and goes on. A loop that stops at the error leaves nothing running.
        * A source with a length is not asked for what follows its ``expected``-th batch
          until the consumer asks for it (:meth:`ask_for_end`): frameworks (Lightning) take
          ``len(loader)`` batches and never exhaust the loader's iterator, and exhausting it
          has effects (a ``RandomSampler`` draws once more from the loader's generator). Past
          that point (``len()`` was an estimate, or an epoch resumed there) the consumer has
          asked already, in this run or the one that saved the state.
        * Across epochs, the next epoch is opened (``set_epoch`` called, its order drawn) only
          once the consumer has taken the epoch's end (``taken_end``); until then it may still
          stop early, and a framework may still set the sampler's epoch itself. The consumer
          calls ``set_epoch`` for the next epoch as it takes the end.
        * Except once the consumer has shown that it asks for the end (``asks_for_end``: a
          plain ``for`` loop): from then on the producer pulls each end and opens the next
          epoch as soon as it gets there, calling ``set_epoch`` itself, so that no epoch starts
          with an empty pipeline. ``open_lock`` makes exactly one of the two call it.
        * The sampler's epoch marks are read around each draw: an order drawn while someone
          set the epoch is marked ``STALE`` and never handed out.
        * While ``epochs.draws.in_step`` (a source that may draw from the global generators),
          nothing is pulled before the consumer asks for it (``wanted``), so the source's
          draws keep their place among the loop's own (see :mod:`nostall._sources.global_draws`).
    """

    def __init__(
        self,
        channel: Channel,
        staging: Staging,
        epochs: EpochSource,
        *,
        epoch: int = 0,
        on_first_batch: Callable[[Staged], None] | None = None,
    ) -> None:
        self.channel = channel
        me = weakref.ref(self)  # not self: no cycle keeps a dropped channel's batches alive
        channel.phase = lambda: "ended" if (puller := me()) is None else puller.doing()
        self.staging = staging
        self.epochs = epochs
        # A threaded epoch starts batches ahead only into this channel's free slots.
        epochs.room = channel.free_slots
        #: The source's iterator for ``epoch``; None between epochs and once finished.
        self.batches: Any = None
        self.epoch = epoch  # the epoch being pulled
        self.pulled = 0  # batches of that epoch taken from the source so far
        #: Nothing more will be pulled: the source ended (one epoch), failed, or was let go.
        self.finished = False
        self.pull_lock = threading.Lock()
        #: What the puller is doing now (see :attr:`phase`): a text, or, per batch, ``_NEXT``
        #: (batch ``pulled``) or ``_MOVING`` (batch ``pulled - 1``), formatted only when read.
        self._phase = "not started"
        #: Called once with the first staged batch (``depth="auto"`` sizes its budget there).
        self.on_first_batch = on_first_batch
        #: Set once the producer thread gave itself its own intra-op thread count.
        self.threads_set = threading.Event()
        #: The last epoch whose end the consumer took (the one before ``epoch`` at first).
        self.taken_end = epoch - 1
        #: The consumer asked for the end of an epoch: it will ask again (a plain loop).
        self.asks_for_end = False
        #: While a batch failed and the consumer has not asked for what follows it: (epoch,
        #: messages up to and including the failed batch); the consumer asks for what follows
        #: the error only once it handed out that many. None otherwise.
        self.paused_at: tuple[int, int] | None = None
        #: Serialises who calls ``set_epoch`` for the next epoch: the producer opening it
        #: ahead, or the consumer taking the end.
        self.open_lock = threading.Lock()
        #: Batches in the epoch being pulled (``len(source)``), when the source has a length.
        self.expected: int | None = None
        #: ``EpochSource.marks()`` read right after each epoch's order was drawn, by epoch
        #: (``STALE`` when they changed while it was drawn), and before each was opened here.
        self.marks: dict[int, Any] = {}
        self.open_marks: dict[int, Any] = {}
        #: In step with the loop (``epochs.draws.in_step``): the loop asks for the next message
        #: now; cleared at the end of each pull made in step.
        self.wanted = threading.Event()
        #: ``batches`` was created and nothing pulled from it yet (in step, that first pull is
        #: where a sampler draws its order, and is not judged).
        self.untouched = False
        #: The producer thread pulls nothing while set: the consumer pulls each batch when it
        #: asks, as a serial loop does (set by :class:`nostall._engine.overlap.Overlap`).
        self.inline = False
        #: How the state after each batch of the open epoch is had, fixed as it opens (see
        #: ``EpochSource.state_per_batch``): (asked of the source, or None; else one record).
        self._per_batch: tuple[Callable[[], Any] | None, Any] = (None, None)

    def open(self, epoch: int, *, forward: bool, outside: bool = False) -> None:
        """Create the source's iterator for ``epoch`` (in the consumer's thread, at its start)."""
        self.staging.before_epoch()
        with self.staging.source_context():
            self.batches, self.pulled = self.epochs.open(epoch, forward=forward, outside=outside)
        self.untouched = True
        self.epochs.draws.forget_left()  # its draws, in this thread, precede its first pull
        self._opened(epoch)

    def _opened(self, epoch: int) -> None:
        """``epoch``'s iterator was made: what each of its batches is pulled with, decided once."""
        self.expected = self.epochs.length()
        self._per_batch = self.epochs.state_per_batch(epoch)

    # -- either thread, holding pull_lock ------------------------------------------------------

    def pull(self) -> Message:
        """Take the next batch from the source and stage it; the caller holds ``pull_lock``.

        In step with the loop (see :mod:`nostall._sources.global_draws`), the pull is watched for
        draws from the global generators, and the next one waits for the loop to ask.
        """
        draws = self.epochs.draws
        if not draws.watched:
            return self.pull_unwatched()
        first = self.batches is None or self.untouched
        ahead = first and isinstance(self.batches, TakenAhead)  # its batch already pulled
        message = draws.pull(self.pull_unwatched, first=first, ahead=ahead, at=self._at)
        self.untouched = False
        self.wanted.clear()
        if not self.epochs.draws.in_step:  # read again: the pull may have judged it
            self.channel.wake.set()  # judged clear: the producer may run ahead from now on
        return message

    def _at(self) -> tuple[int, int]:
        """The epoch being pulled and its batches pulled so far (after a pull: its place)."""
        return self.epoch, self.pulled

    @property
    def phase(self) -> str:
        """What the puller is doing now, in words; read in error messages."""
        phase = self._phase
        if phase is _NEXT:
            return f"next(source) for batch {self.pulled}"
        if phase is _MOVING:
            return f"moving batch {self.pulled - 1} to {self.staging.device}"
        return phase

    @phase.setter
    def phase(self, text: str) -> None:
        self._phase = text

    def pull_unwatched(self) -> Message:
        """:meth:`pull`, unwatched: what the callers call while ``epochs.draws.in_step`` is off.

        Errors come back as the same object with a note of where they happened. Across
        epochs, an epoch's end is followed by the next epoch's batches. Per batch it makes
        as few calls as it can: every one holds the GIL between the source's calls and the
        staging's, which on a GPU release it (see :mod:`nostall._engine.overlap`).
        """
        epoch = self.epoch
        epochs = self.epochs
        if self.batches is None:  # across epochs: the next one starts here
            name = threading.current_thread().name
            self._phase = f"iter(source) for epoch {epoch}"
            with self.open_lock:
                if self.taken_end < epoch - 1:
                    # Ahead of a consumer that asks for each end: nostall counts the epochs.
                    epochs.forward_epoch(epoch)
                self.open_marks[epoch] = epochs.marks()
            try:
                self.staging.before_epoch()
                with self.staging.source_context():
                    self.batches, self.pulled = epochs.open(epoch, forward=False)
            except BaseException as e:
                return self._failed(e, f"raised by iter(source) for epoch {epoch}, in {name!r}")
            self._opened(epoch)
        index = self.pulled
        self._phase = _NEXT
        staging = self.staging
        try:
            if staging.plain_source:
                batch = next(self.batches)
            else:
                with staging.source_context():
                    batch = next(self.batches)
        except StopIteration:
            self.batches = None
            if epoch not in self.marks:
                self._mark_drawn(epoch)
            if epochs.across_epochs:
                self.epoch, self.pulled = epoch + 1, 0
            else:
                self.finished = True
            end_state = functools.partial(epochs.end_state, epoch)
            return self._with_state(END, index, epoch, end_state, epochs.after_pull(True))
        except BaseException as e:
            self._phase = f"next(source) for batch {index}"  # before pulled moves past it
            self.pulled += 1  # the source moved past it: the next pull asks for the next batch
            name = threading.current_thread().name
            where = f"raised by next(source) for batch {index}, in {name!r}"
            # A bare EOFError or connection reset from torch: say which worker died, if one did.
            dead = dead_workers_behind(e) if isinstance(e, (EOFError, ConnectionError)) else []
            if dead:
                where += (
                    f", a DataLoader worker having died ({'; '.join(dead)}; a SIGKILL is often "
                    f"the out-of-memory killer: lower num_workers, batch_size or prefetch_factor)"
                )
            return self._failed(e, where)
        finally:
            if self.batches is not None and epoch not in self.marks:
                self._mark_drawn(epoch)  # the order is drawn by now
        hook = None if epochs.mirror is None else epochs.after_pull(False)
        self._phase = _MOVING
        self.pulled += 1
        try:
            staged = staging.stage(batch)
        except BaseException as e:
            name = threading.current_thread().name
            what = "moving" if staging.transform is None else "moving and transforming"
            where = f"raised while {what} batch {index} to {staging.device}, in {name!r}"
            return self._failed(e, where, hook)
        if self.on_first_batch is not None:
            on_first, self.on_first_batch = self.on_first_batch, None
            on_first(staged)
        ask, same = self._per_batch
        if ask is None:
            return BATCH, staged, epoch, same, hook
        try:
            return BATCH, staged, epoch, ask(), hook
        except BaseException as e:
            return self._failed(e, "raised by the source's state_dict()", hook)

    def doing(self) -> str:
        """What the producer does now and, inside the source, where (for messages)."""
        phase = self.phase
        if not phase.startswith("next(source)"):
            return phase
        waiting_on = getattr(self.batches, "waiting_on", None)  # a threaded epoch's sample
        where = waiting_on() if callable(waiting_on) else ""
        where = where or str(stuck_at(self.channel.thread))
        return f"{phase}: {where}" if where else phase

    def _mark_drawn(self, epoch: int) -> None:
        """Record the sampler's epoch marks an order was drawn with (STALE if they moved)."""
        after = self.epochs.marks()
        before = self.open_marks.get(epoch, after)
        self.marks[epoch] = after if after == before else STALE

    def _with_state(
        self, kind: Kind, payload: Any, epoch: int, state: Callable[[], Any], hook: Any
    ) -> Message:
        try:
            return kind, payload, epoch, state(), hook
        except BaseException as e:
            return self._failed(e, "raised by the source's state_dict()", hook)

    def _failed(self, error: BaseException, where: str, hook: Any = None) -> Message:
        """An error message: one batch's (the epoch goes on) or the epoch's (it ends).

        Except this thread being let go (``ThreadLetGo``: at exit, or stuck past a timeout):
        that is raised on, ending the thread with nothing sent, never handed to a consumer.
        """
        if isinstance(error, ThreadLetGo):
            self.batches, self.finished = None, True
            raise error
        ends_epoch = self.batches is None or not isinstance(error, Exception)
        if ends_epoch:
            self.batches, self.finished = None, True
        else:
            # Nothing more is pulled until the consumer asks; pulled counts the failed batch.
            self.paused_at = (self.epoch, self.pulled)
            self.channel.wake.set()
        state = None
        if not ends_epoch:
            try:  # where a checkpoint taken after this error resumes: after the failed batch
                state = self.epochs.batch_state(self.epoch)
            except Exception:
                state = None
        return FAILED if ends_epoch else ERROR, noted(error, where), self.epoch, state, hook

    # -- the gate: may the next pull happen now? -----------------------------------------------

    def gate_open(self) -> bool:
        """Whether the next pull may happen now (see the class invariants)."""
        if self.finished:
            return True
        if self.epochs.draws.in_step and not self.wanted.is_set():
            return False  # in step with the loop: only what it asks for, when it asks
        if self.asks_for_end:
            return True
        if self.batches is None:  # the next epoch
            return self.taken_end >= self.epoch - 1
        # At the epoch's len() the end waits for the consumer's request (``asks_for_end``,
        # above); past it, it was asked for (see the class invariants).
        return not self.expected or self.pulled != self.expected

    @property
    def after_error(self) -> bool:
        """A batch failed and the consumer has not asked for what follows it yet."""
        return self.paused_at is not None

    def go_on(self) -> None:
        """The consumer asks for what follows the failed batch: pulling may go on."""
        self.paused_at = None

    def set_inline(self, inline: bool) -> None:
        """Pull inline (the consumer pulls each batch) or ahead (the producer thread does)."""
        self.inline = inline
        if not inline:
            self.channel.wake.set()

    def producer_may_pull(self) -> bool:
        """Whether the producer thread may pull the next batch now.

        Not while pulling inline (the consumer pulls each batch), unless the consumer waits
        for one instead (it found the puller busy); then, and otherwise, at the gate.
        """
        if self.inline and not self.channel.waiting.is_set():
            return self.finished  # held back: the consumer pulls, unless it waits instead
        return self.gate_open()

    def wait_at_gate(self) -> bool:
        """Wait until the producer may pull; False once the channel was let go."""
        channel = self.channel
        while not self.producer_may_pull():
            if channel.stop.is_set():
                return False
            if self.paused_at is not None:
                return True  # the caller pauses: see produce()
            channel.wake.wait(POLL_S)
            channel.wake.clear()
        return not channel.stop.is_set()

    # -- consumer side -------------------------------------------------------------------------

    def pull_here(self, wait: bool = False) -> Message | None:
        """Pull the next message in the consumer's thread, or None when it may not.

        Only when nothing is queued, the producer is not inside the source, and the consumer
        has asked for it (the gate is open): then it would only wait for the same work.
        ``wait``: pulling inline, wait for a pull the producer is making (then take its batch
        from the queue) rather than wait for the producer to pull the next one too.
        """
        if self.finished:
            return None
        if wait:  # for the lock, not for a batch; but not past a stop (close(), a newer iter())
            while not self.pull_lock.acquire(timeout=POLL_S):
                if self.finished or self.channel.stop.is_set() or not self.channel.empty():
                    return None  # get() takes the producer's batch, or says why none comes
        elif not self.pull_lock.acquire(blocking=False):
            return None  # nothing to pull, or the producer is pulling: wait for its batch
        try:
            if self.finished or not self.channel.empty() or not self.gate_open():
                return None  # one was queued just before the lock, or it is not asked for
            pull = self.pull if self.epochs.draws.watched else self.pull_unwatched
            if self.staging.plain_source:  # nothing to set around the pull (off CUDA)
                message = pull()
            else:
                with self.staging.pull_context():
                    message = pull()
            if message[0] is END or message[0] is FAILED:
                self.channel.wake.set()  # a producer held back inline ends now, not at its poll
            return message
        finally:
            self.pull_lock.release()

    def want(self, wake: bool) -> None:
        """In step with the loop: the consumer asks for the next message now.

        ``wake``: wake the producer to pull it; not needed when the consumer may pull it
        itself (no timeout: see :meth:`Channel.get`), where a producer woken for nothing
        would only contend with it (the producer still sees ``wanted`` at its next look).
        """
        self.wanted.set()
        if wake:
            self.channel.wake.set()

    def ask_for_end(self) -> None:
        """The consumer asks for what follows the epoch's last batch."""
        self.asks_for_end = True
        self.channel.wake.set()

    def took_end(self, epoch: int, next_epoch: Callable[[], None] | None) -> None:
        """The consumer took ``epoch``'s end.

        ``next_epoch`` calls ``set_epoch`` for the next epoch, unless the producer already did,
        opening it ahead.
        """
        with self.open_lock:
            self.taken_end = epoch
            if next_epoch is not None and epoch + 1 not in self.open_marks:
                next_epoch()
        self.channel.wake.set()

    def stop(self, why: str = "it was let go") -> None:
        """Let the channel go: the producer ends at its next wait, pulling nothing more.

        ``why``: what a consumer still waiting on the channel is told. An epoch loaded by
        threads (``threads=``) lets them go too: a kept exception's frames may hold it alive.
        """
        self.channel.wake_to_stop(why)
        let_go = getattr(self.batches, "let_go", None)
        if callable(let_go):
            let_go()

    @property
    def stopped(self) -> bool:
        return self.channel.stop.is_set()

    def wait_idle(self) -> None:
        """Return once no pull is under way (one may be opening an epoch: ``set_epoch``)."""
        with self.pull_lock:
            pass
