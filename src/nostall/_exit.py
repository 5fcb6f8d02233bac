"""The threads interpreter exit waits for: every producer and loading thread nostall starts.

A thread still releases its last objects (tensors, a loader's iterator) after its work ended;
left to run into the interpreter's finalisation, a daemon thread that comes back from C++ code
(a torch op that released the GIL) is ended inside that code, which aborts the process
("terminate called without an active exception", status -6, whatever the script's own exit
status was). So exit (:func:`wind_down`) waits, a bounded time, for every thread registered
here; then it interrupts those still running between two of their Python steps, where ending
them is harmless, and waits again. Only a thread that stays inside one C call for the whole
second wait is left running: if that call never returns, the process exits normally; only one
that returns during finalisation can still abort it. A thread that uses no CPU time for
:data:`BLOCKED_S` during the second wait is inside a call that waits (a sleep, a read, a lock)
rather than one that computes: exit stops waiting for it then, as a DataLoader's exit stops
waiting for a stuck worker process, rather than after the whole wait.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref

_tracked: weakref.WeakSet[threading.Thread] = weakref.WeakSet()

#: Set once the interpreter began to exit: threads take no new work (see ``_pool.Pool``).
exiting = threading.Event()

#: Seconds exit waits, after interrupting the threads still running, for them to end.
INTERRUPT_WAIT_S = 10.0

#: Seconds between two interrupts of a thread that is still running.
RESEND_S = 0.5

#: Seconds without CPU time after which a thread still running at exit is taken to wait in C.
BLOCKED_S = 2.0


class ThreadLetGo(SystemExit):
    """Raised inside a nostall thread that is let go: at exit, or stuck past a timeout.

    (See :func:`wind_down` and ``_latest_producer.LatestProducer.let_go_of_stuck``.)

    A ``SystemExit``: a dataset's ``except Exception`` does not swallow it, and a thread it
    ends prints nothing.
    """


def track(thread: threading.Thread) -> threading.Thread:
    """Have interpreter exit wait for ``thread``; returns it."""
    _tracked.add(thread)
    return thread


def join_tracked(deadline: float) -> None:
    """Wait for every tracked thread still running, until ``deadline`` (``time.monotonic``)."""
    for thread in list(_tracked):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def interrupt(thread: threading.Thread) -> bool:
    """Raise :class:`ThreadLetGo` in ``thread`` at its next Python step; True if sent.

    A thread inside a C call gets it when the call returns (a torch op: when the op is done).
    """
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return False
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    sent = set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(ThreadLetGo))
    return bool(sent == 1)


def wind_down(polite_s: float, interrupt_s: float | None = None) -> list[threading.Thread]:
    """At exit: wait ``polite_s`` for the tracked threads, interrupt the rest, wait again.

    The second wait is ``interrupt_s``, by default :data:`INTERRUPT_WAIT_S` as it is at exit
    (read then, so that a script can shorten it). Returns the threads still running after both
    waits. The caller has asked every producer to stop first.
    """
    if interrupt_s is None:
        interrupt_s = INTERRUPT_WAIT_S
    exiting.set()
    join_tracked(time.monotonic() + polite_s)
    me = threading.current_thread()
    running = [t for t in list(_tracked) if t.is_alive() and t is not me]
    deadline = time.monotonic() + interrupt_s
    used = {t: (cpu_ticks(t), time.monotonic()) for t in running}  # CPU time, and since when
    waiting: list[threading.Thread] = []  # in a call that waits, not one that computes
    while running and time.monotonic() < deadline:
        for thread in running:
            interrupt(thread)  # again each round: a thread may have caught the last one
        until = min(deadline, time.monotonic() + RESEND_S)
        for thread in running:
            thread.join(max(0.0, until - time.monotonic()))
        running = [t for t in running if t.is_alive()]
        for thread in running:
            ticks, since = used[thread]
            now = cpu_ticks(thread)
            if ticks is None or now != ticks:
                used[thread] = (now, time.monotonic())
            elif time.monotonic() - since >= BLOCKED_S:
                waiting.append(thread)
        running = [t for t in running if t not in waiting]
    return running + [t for t in waiting if t.is_alive()]


def cpu_ticks(thread: threading.Thread) -> int | None:
    """The CPU time ``thread`` has used, in clock ticks; None where it cannot be read.

    Read from ``/proc`` (Linux): its user and system time, fields 14 and 15 of the thread's
    ``stat``, found by splitting what follows the command name (which may hold spaces and
    parentheses) at its last closing parenthesis.
    """
    native = thread.native_id
    if native is None:
        return None
    try:
        with open(f"/proc/self/task/{native}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_tracked.clear)  # the threads exist in the parent only
