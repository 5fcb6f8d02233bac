"""The bounded hand-off between one producer thread and its consumer, and the producer loop.

The producer thread is given only a :class:`Channel`, the source's iterator and the staging
object; it holds no reference to the prefetcher or to the iteration that started it, so dropping
those is enough for the garbage collector to collect them and stop the thread.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

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


class Channel:
    """A bounded queue of staged batches from one producer thread to one consumer.

    Invariant: ``slots`` value + messages in ``items`` + (1 while the producer holds a slot)
    == ``depth``. The producer takes a slot before it pulls a batch from the source and the
    consumer gives it back when it takes the batch, so at most ``depth`` batches have been pulled
    from the source and not yet handed to the consumer.
    """

    def __init__(self, depth: int, describe: str) -> None:
        self.depth = depth
        self.describe = describe  # the source, for messages
        self.slots = threading.Semaphore(depth)
        self.items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        #: What the producer is doing now; written by the producer, read in error messages.
        self.phase = "not started"

    # -- producer side -------------------------------------------------------------------------

    def acquire(self) -> bool:
        """Take a slot for the next batch; False once the consumer asked the producer to stop."""
        while not self.slots.acquire(timeout=POLL_S):
            if self.stop.is_set():
                return False
        return not self.stop.is_set()

    def put(self, kind: str, payload: Any) -> None:
        """Send a message that already owns a slot."""
        self.items.put((kind, payload))

    # -- consumer side -------------------------------------------------------------------------

    def get(self, index: int, timeout: float | None) -> tuple[str, Any]:
        """Wait for the next message; ``index`` is the batch's number in the epoch, for messages.

        Raises:
            PrefetchTimeoutError: nothing arrived within ``timeout`` seconds.
            ProducerDiedError: the producer thread ended without sending anything.
        """
        try:
            message = self.items.get_nowait()
        except queue.Empty:
            message = self._wait(index, timeout)
        self.slots.release()
        return message

    def _wait(self, index: int, timeout: float | None) -> tuple[str, Any]:
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

    def drain(self) -> list[tuple[str, Any]]:
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


def produce(channel: Channel, batches: Iterator[Any], staging: Staging) -> None:
    """Body of a producer thread: pull, stage and send batches until the end, an error or stop.

    Every batch pulled from ``batches`` is sent, even when a stop arrives meanwhile, so that a
    one-shot source loses nothing. Errors are sent as the same object, with a note of where
    they happened; the loop then ends.
    """
    _live.add(channel)
    name = threading.current_thread().name
    index = 0
    try:
        channel.phase = "preparing the thread"
        try:
            staging.start_thread()
        except BaseException as e:
            _fail(channel, e, f"raised in thread {name!r} while preparing it for {staging.device}")
            return
        while channel.acquire():
            channel.phase = f"next(source) for batch {index}"
            try:
                batch = next(batches)
            except StopIteration:
                channel.put(END, index)
                return
            except BaseException as e:
                _fail(channel, e, f"raised by next(source) for batch {index}, in thread {name!r}")
                return
            channel.phase = f"moving batch {index} to {staging.device}"
            try:
                staged: Staged = staging.stage(batch)
            except BaseException as e:
                _fail(
                    channel,
                    e,
                    f"raised while moving batch {index} to {staging.device}, in thread {name!r}",
                )
                return
            del batch
            channel.put(BATCH, staged)
            index += 1
    finally:
        channel.phase = "ended"
        _live.discard(channel)


def _fail(channel: Channel, error: BaseException, where: str) -> None:
    add_note(error, f"nostall: {where}; re-raised in the consumer after the batches before it")
    channel.put(ERROR, error)


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
