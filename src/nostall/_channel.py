"""The bounded hand-off between one producer thread and its consumer, and the producer loop.

The producer thread is given only a :class:`Channel` (the source's iterator, the staging object
and the epoch opener travel inside it); it holds no reference to the prefetcher or to the
iteration that started it, so dropping those is enough for the garbage collector to collect
them and stop the thread.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._epochs import EpochSource
from ._exceptions import PrefetchTimeoutError, ProducerDiedError
from ._transfer import Staged, Staging

#: How often blocked waits wake up to look at the stop flag or the producer's health (seconds).
POLL_S = 0.1
#: How long interpreter exit waits, in all, for live producers to stop (seconds).
EXIT_JOIN_S = 2.0

# Kinds of message on a channel.
BATCH = "batch"
END = "end"
ERROR = "error"

#: (kind, payload, epoch, state): a staged batch, an epoch's end (payload: its batch count) or
#: an error; the epoch it belongs to; what a state saved right after it needs.
Message = tuple[str, Any, int, Any]


class Channel:
    """A bounded queue of staged batches from one producer thread to one consumer.

    Invariants:
        * ``slots`` value + messages in ``items`` + (1 while the producer holds a slot)
          == ``depth``. The producer takes a slot before it pulls from the source and the
          consumer gives it back when it takes the message, so at most ``depth`` batches (and
          epoch ends) have been pulled and not yet handed to the consumer, across epochs too.
        * Pulls are serialised by ``pull_lock``, and a pulled batch is queued before the lock is
          released. When nothing is queued and the producer is not pulling, the consumer may
          pull the next batch itself (see :meth:`get`): it would otherwise wait for the same
          work, and on a fast source this saves two thread switches per batch. Both rules
          together keep every batch once and in order.
        * Once ``finished``, nothing more is pulled.
    """

    def __init__(
        self,
        depth: int,
        describe: str,
        batches: Iterator[Any] | None,
        staging: Staging,
        epochs: EpochSource,
        *,
        epoch: int = 0,
        pulled: int = 0,
        max_depth: int | None = None,
    ) -> None:
        self.depth = depth
        #: With ``depth="auto"``: how deep it may grow (None once the memory budget is known).
        self.auto_limit = max_depth
        self.describe = describe  # the source, for messages
        self.staging = staging
        self.epochs = epochs
        #: The source's iterator for ``epoch``; None between epochs and once finished.
        self.batches = batches
        self.epoch = epoch  # the epoch being pulled
        self.pulled = pulled  # batches of that epoch taken from the source so far
        #: Nothing more will be pulled: the source ended (one epoch), failed, or was let go.
        self.finished = False
        self.slots = threading.Semaphore(depth)
        self.items: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self.pull_lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        #: What the puller is doing now; read in error messages.
        self.phase = "not started"
        #: Called once with the first staged batch (``depth="auto"`` sizes its budget there).
        self.on_first_batch: Callable[[Staged], None] | None = None

    # -- either side, holding pull_lock ----------------------------------------------------------

    def pull(self) -> Message:
        """Take the next batch from the source and stage it; the caller holds ``pull_lock``.

        Errors come back as the same object with a note of where they happened. Across
        epochs, an epoch's end is followed by the next epoch's batches.
        """
        epoch = self.epoch
        name = threading.current_thread().name
        if self.batches is None:  # across epochs: the next one starts here
            self.phase = f"iter(source) for epoch {epoch}"
            try:
                self.batches, self.pulled = self.epochs.open(epoch)
            except BaseException as e:
                return self._failed(e, f"raised by iter(source) for epoch {epoch}, in {name!r}")
        index = self.pulled
        self.phase = f"next(source) for batch {index}"
        try:
            batch = next(self.batches)
        except StopIteration:
            self.batches = None
            if self.epochs.across_epochs:
                self.epoch, self.pulled = epoch + 1, 0
            else:
                self.finished = True
            return self._with_state(END, index, epoch, self.epochs.end_state)
        except BaseException as e:
            return self._failed(e, f"raised by next(source) for batch {index}, in {name!r}")
        self.phase = f"moving batch {index} to {self.staging.device}"
        try:
            staged = self.staging.stage(batch)
        except BaseException as e:
            where = f"raised while moving batch {index} to {self.staging.device}, in {name!r}"
            return self._failed(e, where)
        self.pulled += 1
        if self.on_first_batch is not None:
            hook, self.on_first_batch = self.on_first_batch, None
            hook(staged)
        return self._with_state(BATCH, staged, epoch, lambda: self.epochs.batch_state(epoch))

    def _with_state(self, kind: str, payload: Any, epoch: int, state: Callable[[], Any]) -> Message:
        try:
            return kind, payload, epoch, state()
        except BaseException as e:
            return self._failed(e, "raised by the source's state_dict()")

    def _failed(self, error: BaseException, where: str) -> Message:
        self.batches, self.finished = None, True
        return ERROR, _noted(error, where), self.epoch, None

    # -- producer side -------------------------------------------------------------------------

    def acquire(self) -> bool:
        """Take a slot for the next batch; False once the consumer asked the producer to stop."""
        while not self.slots.acquire(timeout=POLL_S):
            if self.stop.is_set():
                return False
        return not self.stop.is_set()

    def put(self, message: Message) -> None:
        """Send a message that already owns a slot."""
        self.items.put(message)

    # -- consumer side -------------------------------------------------------------------------

    def get(self, index: int, timeout: float | None) -> Message:
        """Return the next message; ``index`` is the batch's number in the epoch, for messages.

        Without a ``timeout``, when nothing is queued and the producer is not inside the
        source, the batch is pulled here, in the consumer's thread (no slot is involved).

        Raises:
            PrefetchTimeoutError: nothing arrived within ``timeout`` seconds.
            ProducerDiedError: the producer thread ended without sending anything.
        """
        try:
            message = self.items.get_nowait()
        except queue.Empty:
            if self.auto_limit is not None:
                self._grow()
            # A pull here cannot be interrupted by a timeout, so none is done when one is set.
            stolen = self._pull_here() if timeout is None else None
            if stolen is not None:
                return stolen
            message = self._wait(index, timeout)
        self.slots.release()
        return message

    def _grow(self) -> None:
        """The queue ran dry: double the depth, up to ``auto_limit`` (tf.data's prefetch rule)."""
        assert self.auto_limit is not None
        grown = min(self.depth * 2, self.auto_limit)
        if grown > self.depth:
            self.slots.release(grown - self.depth)  # the invariant holds with the new depth
            self.depth = grown

    def _pull_here(self) -> Message | None:
        thread = self.thread
        if self.finished or thread is None or not thread.is_alive():
            return None  # nothing to pull, or a dead producer that _wait must report
        if not self.pull_lock.acquire(blocking=False):
            return None  # the producer is pulling: wait for its batch
        try:
            if self.finished or not self.items.empty():
                return None  # it queued one just before we took the lock: _wait takes it
            return self.pull()
        finally:
            self.pull_lock.release()

    def _wait(self, index: int, timeout: float | None) -> Message:
        start = time.monotonic()
        while True:
            wait = POLL_S
            if timeout is not None:
                left = timeout - (time.monotonic() - start)
                if left <= 0:
                    raise PrefetchTimeoutError(
                        f"no batch arrived within timeout={timeout} s: batch {index} of the "
                        f"epoch from {self.describe}; the producer thread "
                        f"{self._thread_name()} is busy with {self.phase}. Raise timeout= if the "
                        f"source is slow but alive; nothing was lost, next() waits again"
                    )
                wait = min(wait, left)
            try:
                return self.items.get(timeout=wait)
            except queue.Empty:
                pass
            if self.thread is None or not self.thread.is_alive():
                try:  # it may have sent its last message just before it ended
                    return self.items.get_nowait()
                except queue.Empty:
                    raise ProducerDiedError(
                        f"the producer thread {self._thread_name()} ended without delivering "
                        f"batch {index} of the epoch from {self.describe}, the end of the epoch "
                        f"or an error (last seen: {self.phase}); this is a bug in nostall, "
                        f"please report it"
                    ) from None

    def _thread_name(self) -> str:
        return repr(self.thread.name) if self.thread is not None else "(none)"

    def drain(self) -> list[Message]:
        """Take every message still queued (the producer must have ended)."""
        messages = []
        while True:
            try:
                messages.append(self.items.get_nowait())
            except queue.Empty:
                return messages


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (shown under its traceback on Python 3.11+)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: keep the note where 3.11+ would, for anyone who looks
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list):
            notes.append(note)
        else:
            with contextlib.suppress(AttributeError):
                error.__notes__ = [note]  # type: ignore[attr-defined]


def produce(channel: Channel) -> None:
    """Body of a producer thread: pull, stage and send batches until finished or stopped.

    Every batch pulled from the source is sent, even when a stop arrives meanwhile, so that a
    one-shot source loses nothing. The source's iterator is let go here, in this thread, when
    the loop ends (a DataLoader's workers shut down with it).
    """
    _live.add(channel)
    try:
        try:
            channel.staging.start_thread()
        except BaseException as e:
            if channel.acquire():
                name = threading.current_thread().name
                with channel.pull_lock:
                    where = f"raised in {name!r} while preparing it for {channel.staging.device}"
                    channel.put(channel._failed(e, where))
            return
        while channel.acquire():
            with channel.pull_lock:
                if channel.finished:
                    return  # the consumer pulled the end or an error itself
                message = channel.pull()
                channel.put(message)
            kind = message[0]
            del message  # the consumer owns the batch now
            if kind is ERROR or (kind is END and not channel.epochs.across_epochs):
                return
    finally:
        with channel.pull_lock:
            channel.batches, channel.finished = None, True
        channel.phase = "ended"
        _live.discard(channel)


def _noted(error: BaseException, where: str) -> BaseException:
    add_note(error, f"nostall: {where}; re-raised in the consumer after the batches before it")
    return error


# Channels whose producer thread is running, so that interpreter exit can stop them first.
_live: set[Channel] = set()


def stop_all_producers(timeout: float = EXIT_JOIN_S) -> None:
    """Ask every live producer to stop and wait up to ``timeout`` seconds in all for them."""
    channels = list(_live)
    for channel in channels:
        channel.stop.set()
    deadline = time.monotonic() + timeout
    for channel in channels:
        thread = channel.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def join_quietly(thread: threading.Thread | None, timeout: float) -> bool:
    """Join ``thread`` unless the interpreter is finalising; True if it is no longer running."""
    if thread is None or not thread.is_alive():
        return True
    if sys.is_finalizing() or thread is threading.current_thread():
        return False
    thread.join(timeout)
    return not thread.is_alive()


# Runs before the interpreter finalises (and before torch's own exit handler, registered
# earlier), so producers stop while the sources they pull from still work.
atexit.register(stop_all_producers)
