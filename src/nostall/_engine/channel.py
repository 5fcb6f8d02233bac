"""The bounded hand-off between one producer thread and its consumer.

A :class:`Channel` is a queue of messages (a staged batch, an error, the epoch's end) with
``depth`` slots. It knows nothing of sources, epochs or devices: what is pulled, and when, is
the puller's business (:mod:`nostall._engine.producer`); the channel only bounds how far the
producer runs ahead and hands the messages over in the order they were put.
"""

from __future__ import annotations

import enum
import functools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from .._exceptions import PrefetcherClosedError, PrefetchTimeoutError, ProducerDiedError

#: How often blocked waits wake up to look at the stop flag or the producer's health (seconds).
POLL_S = 0.1


class Kind(enum.Enum):
    """What a message on a channel carries."""

    #: A staged batch.
    BATCH = "batch"
    #: The epoch's end (payload: its batch count).
    END = "end"
    #: An error in one batch (its ``next(source)``, its move or transform): the epoch goes on,
    #: as a DataLoader's iterator does after a batch raised.
    ERROR = "error"
    #: An error that ends the epoch: ``iter(source)`` failed, or not an ``Exception`` (e.g. a
    #: ``KeyboardInterrupt`` inside the source).
    FAILED = "failed"


class HandOffObserver(Protocol):
    """Told of the consumer's hand-offs, in the consumer's thread (a threaded epoch's pacer).

    The channel calls it and knows nothing more of it: the loading threads it paces stay out of
    the hand-off (:class:`nostall._loading.pacing.Pacer` is the one there is).
    """

    def handed_off(self) -> None:
        """The consumer got a batch."""

    def drained(self) -> None:
        """The consumer took its last queued batch."""

    def hurry_up(self) -> None:
        """The consumer waits (nothing queued), or the channel is let go."""


# The kinds by name, compared with ``is`` on the hand-off path.
BATCH, END, ERROR, FAILED = Kind.BATCH, Kind.END, Kind.ERROR, Kind.FAILED

#: (kind, payload, epoch, state, hook): a staged batch, an epoch's end (payload: its batch
#: count) or an error; the epoch it belongs to; what a state saved right after it needs; what
#: the source's framework must see when it is handed out (see ``EpochSource.after_pull``).
Message = tuple[Kind, Any, int, Any, Any]

#: Pulls a message in the consumer's thread, or returns None when it may not (see
#: :meth:`Channel.get`).
PullHere = Callable[[], "Message | None"]


class Slots:
    """A counting semaphore whose count may be read; taken and given back in one C call each.

    The free slots are tokens in a ``queue.SimpleQueue``: taking one waits without the GIL
    inside the queue's C code, and giving one back wakes a waiter in the same call, where
    ``threading.Semaphore`` (a ``Condition``) runs about a dozen Python calls for each: calls
    that hold the GIL between the threads' GIL-free work, per batch. ``value`` is the tokens
    queued now: reading it gives a value it had (the producer, the only one that takes
    slots, reads it: it can only grow).
    """

    def __init__(self, value: int) -> None:
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        #: ``take(True, timeout)`` takes one (``queue.Empty`` if none came free in time).
        self.take = self._tokens.get
        #: ``give()`` gives one back and wakes a waiter: no Python frame.
        self.give = functools.partial(self._tokens.put, None)
        self.release(value)

    @property
    def value(self) -> int:
        """Slots free now."""
        return self._tokens.qsize()

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take one; False if none came free (at once, or within ``timeout`` s)."""
        try:
            self.take(blocking, timeout)
        except queue.Empty:
            return False
        return True

    def release(self, n: int = 1) -> None:
        """Give back ``n``, waking as many waiters."""
        for _ in range(n):
            self.give()


class Channel:
    """A bounded queue of messages from one producer thread to one consumer.

    Invariants:
        * ``slots`` value + messages in ``items`` + (1 while the producer holds a slot)
          == ``depth``. Only the channel touches its slots: the producer takes one with
          :meth:`acquire` before it pulls and either sends with :meth:`put` or gives it back
          with :meth:`give_back`; the consumer's :meth:`get` frees it. So at most ``depth``
          messages have been produced and not yet taken, across epochs too.
        * Messages are taken in the order they were put.
        * A message the consumer pulls itself (``pull_here`` in :meth:`get`) never takes a
          slot: nothing was queued, and the caller's ``pull_here`` makes sure nothing is.
        * With ``auto_limit``, ``depth`` doubles (up to the limit) whenever the consumer finds
          the queue empty; it never shrinks.
        * Once ``stop`` is set the channel is let go: the producer ends at its next wait, and
          the slot count no longer matters.
    """

    def __init__(
        self,
        depth: int,
        describe: str,
        *,
        max_depth: int | None = None,
        phase: Callable[[], str] = lambda: "unknown",
        pacer: HandOffObserver | None = None,
    ) -> None:
        self.depth = depth
        #: How deep ``depth`` may grow (``depth="auto"``); None: it stays as it is.
        self.auto_limit = max_depth
        self.describe = describe  # the source, for messages
        #: What the producer is doing now, for error messages.
        self.phase = phase
        self.slots = Slots(depth)
        self.items: queue.SimpleQueue[Message] = queue.SimpleQueue()
        #: Whether nothing is queued now (the queue's own method: asked for every batch).
        self.empty: Callable[[], bool] = self.items.empty
        self.stop = threading.Event()
        #: Why ``stop`` was set, for a consumer still waiting (see :meth:`wake_to_stop`).
        self.stopped_why = ""
        #: Wakes a producer waiting for a slot or for the consumer (set by either side).
        self.wake = threading.Event()
        #: Set while the consumer waits for a message: a producer held back pulls for it.
        self.waiting = threading.Event()
        #: The producer thread; the consumer reports its death instead of waiting forever.
        self.thread: threading.Thread | None = None
        #: Set before the producer thread starts, cleared as its body returns: for the
        #: consumer's steady path, ``thread.is_alive()`` in one call instead of three. A thread
        #: that ended without clearing it (killed at exit) is still seen by the waits below.
        self.producing = threading.Event()
        #: Told of each hand-off: a threaded epoch's pacer (see :class:`HandOffObserver`); None:
        #: unpaced.
        self.pacer = pacer

    # -- producer side -------------------------------------------------------------------------

    def acquire(self, give_up: Callable[[], bool]) -> bool:
        """Take a slot for the next message; False (holding none) once stopped.

        ``give_up()`` is asked while no slot is free: True also returns False. Once a slot
        is taken it is not asked (a call per batch): the caller looks again before pulling.
        """
        take = self.slots.take
        while True:
            try:
                take(True, POLL_S)
                break
            except queue.Empty:
                if self.stop.is_set() or give_up():
                    return False
        if self.stop.is_set():
            self.slots.give()
            return False
        return True

    def give_back(self) -> None:
        """Return a slot taken with :meth:`acquire` for a message that will not be sent."""
        self.slots.release()

    def free_slots(self) -> int:
        """Slots free now (read without taking one: only the producer takes, so it may grow)."""
        return self.slots.value

    def put(self, message: Message) -> None:
        """Send a message that owns a slot taken with :meth:`acquire`."""
        self.items.put(message)

    def put_ready(self, message: Message) -> None:
        """Queue a message made before the producer starts (carried over, or an empty epoch).

        Takes a slot without waiting; with none free, ``depth`` grows by one to hold it (the
        messages carried over from a channel that ``depth="auto"`` had grown deeper).
        """
        if not self.slots.acquire(blocking=False):
            self.depth += 1  # the new slot is taken at once: the invariant holds
        self.items.put(message)

    # -- consumer side -------------------------------------------------------------------------

    def get(self, index: int, timeout: float | None, pull_here: PullHere | None = None) -> Message:
        """Return the next message; ``index`` is the batch's number in the epoch, for messages.

        When nothing is queued and no ``timeout`` is set, ``pull_here()`` is asked first: it
        pulls the next message in this thread, or returns None when it may not (the producer
        is pulling, the consumer has not asked for it, nothing is left); then this waits.

        Raises:
            PrefetchTimeoutError: nothing arrived within ``timeout`` seconds.
            ProducerDiedError: the producer thread ended without sending anything.
        """
        pacer = self.pacer
        if not self.items.empty():  # the only consumer: what it sees queued stays queued
            message = self.items.get_nowait()
            self.slots.give()
            if pacer is not None:
                pacer.handed_off()
                if self.items.empty():
                    pacer.drained()  # a producer waiting to pull takes its wait again
            return message
        if pacer is not None:
            pacer.hurry_up()  # a producer waiting to pull would keep this consumer waiting
        # No ``queue.Empty`` caught on the way here: an exception raised by the pull below
        # would carry it as its context, whose traceback holds this thread's frames (the
        # training loop, the prefetcher). A source's generator that keeps that exception
        # (accelerate's loader yields its last batch inside ``except StopIteration``) would
        # keep them all alive.
        if self.auto_limit is not None:
            self._grow()
        # A pull here cannot be interrupted by a timeout, so none is done when one is set.
        # A dead producer is for _wait to report.
        if timeout is None and pull_here is not None and self.producing.is_set():
            stolen = pull_here()
            if stolen is not None:
                if pacer is not None:
                    pacer.handed_off()
                return stolen
        # Whoever pulls ahead or not, a consumer that waits is served: a producer held back
        # (pulling inline: see ``Puller.producer_may_pull``) pulls for it.
        self.waiting.set()
        self.wake.set()
        try:
            message = self._wait(index, timeout)
        finally:
            self.waiting.clear()
        self.slots.give()
        if pacer is not None:
            pacer.handed_off()
        return message

    def limit_growth(self, most: int) -> None:
        """With ``depth="auto"``: let ``depth`` grow up to ``most`` (it never shrinks)."""
        self.auto_limit = max(most, self.depth)

    def _grow(self) -> None:
        """The queue ran dry: double the depth, up to ``auto_limit`` (tf.data's prefetch rule)."""
        assert self.auto_limit is not None
        grown = min(self.depth * 2, self.auto_limit)
        if grown > self.depth:
            self.slots.release(grown - self.depth)  # the invariant holds with the new depth
            self.depth = grown

    def _producer_alive(self) -> bool:
        thread = self.thread
        return thread is not None and thread.is_alive()

    def _wait(self, index: int, timeout: float | None) -> Message:
        start = time.monotonic()
        while True:
            wait = POLL_S
            if timeout is not None:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    phase = self.phase()
                    raise PrefetchTimeoutError(
                        f"no batch arrived within timeout={timeout} s: batch {index} of the "
                        f"epoch from {self.describe}; the producer thread "
                        f"{self._thread_name()} is busy with {phase}. Raise timeout= if the "
                        f"source is slow but alive; nothing was lost, next() waits again",
                        timeout=timeout,
                        batch=index,
                        phase=phase,
                        thread=None if self.thread is None else self.thread.name,
                    )
                wait = min(wait, left)
            try:
                return self.items.get(timeout=wait)
            except queue.Empty:
                pass
            if self.stop.is_set():
                # Let go while this consumer waited (another thread closed the prefetcher or
                # started a newer iteration): say so, not that the producer died.
                raise PrefetcherClosedError(
                    f"this iteration was stopped while next() waited for batch {index} of the "
                    f"epoch from {self.describe}: {self.stopped_why}; start a new one with "
                    f"iter(prefetcher)"
                )
            if not self._producer_alive():
                try:  # it may have sent its last message just before it ended
                    return self.items.get_nowait()
                except queue.Empty:
                    phase = self.phase()
                    raise ProducerDiedError(
                        f"the producer thread {self._thread_name()} ended without delivering "
                        f"batch {index} of the epoch from {self.describe}, the end of the epoch "
                        f"or an error (last seen: {phase}); this is a bug in nostall, "
                        f"please report it",
                        batch=index,
                        phase=phase,
                        thread=None if self.thread is None else self.thread.name,
                    ) from None

    def _thread_name(self) -> str:
        return repr(self.thread.name) if self.thread is not None else "(none)"

    def drain(self) -> list[Message]:
        """Take every message still queued (the producer must have ended); frees their slots."""
        messages = []
        while True:
            try:
                messages.append(self.items.get_nowait())
            except queue.Empty:
                return messages
            self.slots.release()

    # -- either side ---------------------------------------------------------------------------

    def wake_to_stop(self, why: str = "it was let go") -> None:
        """Let the channel go: the producer stops at its next wait (a slot or the consumer).

        ``why`` is what a consumer still waiting on the channel is told (see :meth:`_wait`).
        """
        self.stopped_why = why
        self.stop.set()
        self.slots.release()  # wakes a producer waiting for a slot at once
        self.wake.set()
        if self.pacer is not None:
            self.pacer.hurry_up()  # and one waiting to start its pull
