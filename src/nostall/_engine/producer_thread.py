"""The producer thread: its body, and the threads interpreter exit and ``fork()`` stop.

:func:`produce` runs a :class:`~nostall._engine.producer.Puller` in a thread of its own until the
puller is finished or its channel let go. Live producers are stopped before the interpreter
exits (:func:`stop_all_producers`, an ``atexit`` hook), and a fork is noticed
(``fork_generation``: producer threads do not survive one).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from .._exit import ThreadLetGo, track, wind_down
from .channel import END, FAILED
from .producer import Puller

#: How long interpreter exit waits, in all, for live producers to stop (seconds).
EXIT_JOIN_S = 2.0


def produce(puller: Puller) -> None:
    """Body of a producer thread: pull, stage and send batches until finished or stopped.

    Every batch pulled from the source is sent, even when a stop arrives meanwhile, so that a
    one-shot source loses nothing. The source's iterator is let go here, in this thread, when
    the loop ends (a DataLoader's workers shut down with it). After an error in one batch the
    thread ends but leaves the iterator to the puller (``after_error``): a loop that stops at
    the error leaves nothing running, and one that goes on starts a new producer.
    """
    channel = puller.channel
    _live.add(puller)
    # Loading threads share the GIL with the consumer's launches: their pulls are paced.
    pacer = puller.epochs.pacer
    paused = False

    def give_up() -> bool:
        return puller.paused_at is not None  # after_error, without its call

    try:
        try:
            puller.staging.start_thread()
            puller.threads_set.set()
        except BaseException as e:
            if channel.acquire(give_up):
                name = threading.current_thread().name
                with puller.pull_lock:
                    where = f"raised in {name!r} while preparing it for {puller.staging.device}"
                    puller.batches = None  # nothing can be staged: the epoch ends here
                    channel.put(puller._failed(e, where))
            return
        while channel.acquire(give_up):
            if pacer is not None and not puller.epochs.draws.in_step:
                pacer.wait(lambda: not channel.empty() and not channel.stop.is_set())
            while True:
                # Held back (pulling inline), it does not even touch the lock: a consumer
                # finding it taken would wait for the producer's batch, turn after turn.
                if puller.inline and not puller.wait_at_gate():
                    channel.give_back()
                    return
                with puller.pull_lock:
                    if puller.finished or channel.stop.is_set():
                        # The consumer pulled the end or an error itself, or let this channel
                        # go (and may now touch the source itself: no pull after a stop).
                        channel.give_back()
                        return
                    if puller.paused_at is not None:  # after_error, without its call
                        channel.give_back()  # the slot taken for a pull that will not happen
                        paused = True
                        return
                    # (The gate alone where not held back: producer_may_pull without its call.)
                    inline = puller.inline
                    if puller.producer_may_pull() if inline else puller.gate_open():
                        if inline:
                            # Held back, it serves one wait of the consumer's: the next
                            # wait asks again (else it would run on ahead, contending).
                            channel.waiting.clear()
                        pull = puller.pull if puller.epochs.draws.watched else puller.pull_unwatched
                        if pacer is None:
                            message = pull()
                        else:
                            began = time.monotonic()
                            message = pull()
                            pacer.pulled(time.monotonic() - began)
                        channel.put(message)
                        break
                # Not now: the gate is closed (asking the source past what was asked for
                # has effects: a sampler's draw at its end), or pulling went inline. Wait
                # outside the lock, so that the consumer may pull, then look again.
                if not puller.wait_at_gate():
                    channel.give_back()
                    return
            kind = message[0]
            del message  # the consumer owns the batch now
            if kind is FAILED or (kind is END and not puller.epochs.across_epochs):
                return
        paused = puller.after_error and not channel.stop.is_set()
    except ThreadLetGo:
        pass  # let go (at exit, or stuck past a timeout): the thread ends, nothing sent
    finally:
        if not paused:
            with puller.pull_lock:
                puller.batches, puller.finished = None, True
        puller.phase = "paused after an error" if paused else "ended"
        _live.discard(puller)
        channel.producing.clear()


# Pullers whose producer thread is running, so that interpreter exit can stop them first.
_live: set[Puller] = set()


def stop_all_producers(timeout: float = EXIT_JOIN_S) -> None:
    """Ask every live producer to stop, and end every nostall thread (see ``_exit.wind_down``).

    ``timeout``: seconds the threads are given to end on their own before being interrupted.
    """
    for puller in list(_live):
        puller.channel.wake_to_stop("the interpreter is exiting")
        if puller.channel.thread is not None:
            track(puller.channel.thread)
    wind_down(timeout)


def join_quietly(thread: threading.Thread | None, timeout: float) -> bool:
    """Join ``thread`` unless the interpreter is finalising; True if it is no longer running."""
    if thread is None or not thread.is_alive():
        return True
    if sys.is_finalizing() or thread is threading.current_thread():
        return False
    thread.join(timeout)
    return not thread.is_alive()


#: Bumped in a child process after ``fork()``: producer threads do not survive a fork, so an
#: iteration started before it cannot deliver batches after it.
fork_generation = 0


def _after_fork_in_child() -> None:
    global fork_generation
    fork_generation += 1
    _live.clear()  # their threads exist in the parent only


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# Runs before the interpreter finalises (and before torch's own exit handler, registered
# earlier), so producers stop while the sources they pull from still work.
atexit.register(stop_all_producers)
