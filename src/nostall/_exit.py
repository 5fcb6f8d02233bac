"""The threads interpreter exit waits for: every producer and loading thread nostall starts.

A thread still releases its last objects (tensors, a loader's iterator) after its work ended;
left to run into the interpreter's finalisation, a daemon thread is ended inside that C++ code,
which aborts the process ("terminate called without an active exception"). So exit waits, a
bounded time, for every thread registered here (see ``_producer.stop_all_producers``).
"""

from __future__ import annotations

import os
import threading
import time
import weakref

_tracked: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def track(thread: threading.Thread) -> threading.Thread:
    """Have interpreter exit wait for ``thread``; returns it."""
    _tracked.add(thread)
    return thread


def join_tracked(deadline: float) -> None:
    """Wait for every tracked thread still running, until ``deadline`` (``time.monotonic``)."""
    for thread in list(_tracked):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tracked.clear)  # the threads exist in the parent only
