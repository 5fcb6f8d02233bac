"""The latest producer thread of a Prefetcher: one pulls from the source at a time.

A new pass's producer starts only once the previous one ended, except one stuck past a
``timeout`` where each epoch is independent of the last (it is let go, as a DataLoader starts
new workers after a timeout). ``close()`` waits a while for it, and says where it is stuck.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from .. import _exit, _stacks
from .._exceptions import PrefetcherClosedError, PrefetchTimeoutError
from .._warn import warn
from . import producer_thread as _producer_thread
from .channel import POLL_S

if TYPE_CHECKING:
    from .._epochs.epochs import EpochSource
    from .producer import Puller

#: How long close() waits for a producer that is inside the source's __next__ (seconds).
CLOSE_JOIN_S = 5.0

#: How long ``close()`` waits for a producer stuck past a timeout, once interrupted (seconds).
STUCK_JOIN_S = 0.5


class LatestProducer:
    """The latest producer thread of one Prefetcher, and whether a timeout found it stuck.

    Invariants:
        * A producer starts (:meth:`started`) only after :meth:`wait_ended` returned: two
          threads never pull from one source, except where a stuck one was let go.
        * ``stuck`` names a producer only while it has not moved since its timeout.
    """

    def __init__(self, epochs: EpochSource) -> None:
        self._epochs = epochs
        self._thread: threading.Thread | None = None
        #: ``_producer_thread.fork_generation`` when built: producers do not survive fork().
        self.fork_generation = _producer_thread.fork_generation
        #: A puller a ``timeout`` was raised on, with its (epoch, pulled) then and the timeout:
        #: stuck in the source while those have not moved (see :meth:`stuck`).
        self._stuck: tuple[weakref.ref[Puller], tuple[int, int], float] | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The latest producer thread (alive or not), None before the first."""
        return self._thread

    def started(self, thread: threading.Thread) -> None:
        """``thread`` now pulls from the source."""
        self._thread = thread

    def forked(self) -> bool:
        """Whether this process was forked since the prefetcher was built."""
        return self.fork_generation != _producer_thread.fork_generation

    def check_not_forked(self) -> None:
        """Refuse to go on in a child process: the producer thread did not survive fork()."""
        if self.forked() and self._thread is not None:
            raise PrefetcherClosedError(
                "this Prefetcher was started in the parent of this process, and its producer "
                "thread did not survive fork(): create the prefetcher (or call nostall.prefetch "
                "again) in the process that iterates it, or use the 'spawn' start method"
            )

    def wait_ended(self, timeout: float | None) -> None:
        """Return once the latest producer ended: two threads must never pull from one source.

        Except a producer a ``timeout`` was raised on (stuck in the source): it is let go
        (:meth:`let_go_of_stuck`), and, if it is still stuck after ``timeout`` and each epoch
        of the source is independent of the previous one, the new iteration starts without
        it, as a DataLoader starts new workers after a timeout (a warning says so).

        Raises:
            PrefetchTimeoutError: it is still inside ``next(source)`` after ``timeout`` s (the
                producer is kept as the latest, so that the caller may try again).
        """
        previous = self._thread
        if previous is None:
            return
        stuck = self.let_go_of_stuck()
        waited = 0.0
        while previous.is_alive():
            if timeout is not None and waited >= timeout:
                where = _stacks.stuck_at(previous)
                at = f" ({where})" if str(where) else ""
                independent = self._epochs.independent_epochs()
                if stuck and independent:
                    warn(
                        f"nostall: the producer thread {previous.name!r} is still inside the "
                        f"previous epoch's source{at} after timeout={timeout} s; this epoch "
                        f"starts from a new iterator without it, as a DataLoader starts new "
                        f"workers after a timeout. That thread ends when the call returns, "
                        f"and what it loads is dropped",
                        RuntimeWarning,
                    )
                    self._thread = None
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
        self._stuck = (weakref.ref(puller), (puller.epoch, puller.pulled), timeout)

    def stuck(self) -> tuple[threading.Thread, float] | None:
        """The latest producer and the timeout, if a timeout marked it and it has not moved.

        Stuck: still alive, still inside ``next(source)``, at the batch it was at when the
        timeout was raised. One that went on since is not stuck (the mark is dropped).
        """
        mark, thread = self._stuck, self._thread
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
            self._stuck = None
            return None
        return thread, timeout

    def let_go_of_stuck(self) -> bool:
        """Whether the latest producer is stuck (see :meth:`stuck`); if so, let it go.

        Where each epoch is independent of the last (``EpochSource.independent_epochs``), it
        is interrupted at its next Python step (a call stuck in C: when it returns), dropping
        what it loads, and loading threads stuck as long are counted no more. Elsewhere the
        stuck call is the dataset's own, and is left alone.
        """
        stuck = self.stuck()
        if stuck is None:
            return False
        thread, timeout = stuck
        if self._epochs.independent_epochs():
            _exit.interrupt(thread)
            self._epochs.let_go_of_loading(timeout)
        return True

    def join_at_close(self) -> None:
        """Wait up to ``CLOSE_JOIN_S`` s for the producer (``STUCK_JOIN_S`` for a stuck one).

        A producer stuck past a timeout is interrupted, and not waited for as long; one still
        inside the source's ``__next__`` afterwards is named, with where it is, in a warning.
        """
        wait = STUCK_JOIN_S if self.let_go_of_stuck() else CLOSE_JOIN_S
        thread = self._thread
        if not _producer_thread.join_quietly(thread, wait) and thread is not None:
            where = _stacks.stuck_at(thread)
            at = f" ({where})" if str(where) else ""
            warn(
                f"nostall: producer thread {thread.name!r} is still inside the source's "
                f"__next__{at} after close() waited {wait:g} s; it will end when that returns",
                RuntimeWarning,
            )
