"""The pool of loading threads that ``threads=`` fetches samples with.

A :class:`Pool` runs tasks (one sample's fetch, see :mod:`nostall._loading.threads`) in the
order they were submitted, on at most ``size`` threads, started when work arrives and ended
when idle, so that ``break``, ``close()`` or an epoch's end leaves no thread behind for long.
Its invariants are in its docstring.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import AbstractContextManager
from typing import Any

from .. import _exit
from .._exceptions import add_note
from .._exit import ThreadLetGo, track
from .._stacks import short
from .._warn import warn

#: Seconds a loading thread waits for work before it ends.
IDLE_S = 0.2


class Pool:
    """Threads running tasks in the order they were submitted; started on demand, idle ones end.

    Invariants, each kept under ``lock``:
        * ``live + len(free_ids) == size``: ``live`` counts the threads that take tasks,
          ``free_ids`` holds the worker ids (0 to size - 1) none of them has. So at most
          ``size`` counted threads run tasks at once, each with its own id (a thread
          :meth:`abandon` stopped counting may still run one: see below).
        * Tasks start in the order they were submitted (``tasks`` is first in, first out).
        * A submitted task is run, or its future fails: it starts a thread when fewer than
          ``size`` are counted, else wakes one. An idle thread decides to end under the lock,
          so it cannot miss a task queued meanwhile. A thread the OS refuses leaves the task
          to the running threads (one warning), or, with none running, fails the task's
          future with the OS's error.
        * A thread ends after :data:`IDLE_S` seconds without a task (at once, once the
          interpreter begins to exit: ``_exit.exiting``), or when :meth:`abandon` stopped
          counting it (after its task returns). An abandoned thread's id is free at once: a
          new thread may hold it while the abandoned one still runs.
        * ``counted`` holds each counted thread by its id; once the interpreter began to exit,
          ``live`` and ``free_ids`` are counted again from it at each :meth:`submit`. A
          thread that ended without giving its place back (interrupted at exit,
          ``ThreadLetGo``, between two of its steps) gives it there, and a task it had taken
          and not finished fails: code that loads after nostall's exit hook ran (an exit
          handler registered before it) gets threads again, and no waiter waits for a task
          nobody runs.
        * ``running`` maps the future of each task being run to its thread and worker id.
        * A task submitted with its epoch's ``dropped`` event, still running once that event
          is set while a task waits for a thread with none idle (asked by the waiter,
          :meth:`free_dropped`), is abandoned: a dropped epoch's thread stuck in a sample (a
          stream's ``__next__`` that never returns) cannot hold the next epoch's place, as a
          DataLoader's new epoch does not wait for its old workers.

    Threads are daemons named ``{name}-{worker id}``, tracked by :mod:`nostall._exit` (an
    interpreter exit waits for them). Every task runs inside ``context()`` (on CUDA the
    prefetcher's device and source stream: GPU work in ``__getitem__`` lands there).
    """

    def __init__(
        self,
        size: int,
        name: str,
        context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.size, self.name, self.context = size, name, context
        self.tasks: collections.deque[tuple[Future[Any], Callable[[int], Any]]] = (
            collections.deque()
        )
        self.lock = threading.Lock()
        self.work = threading.Condition(self.lock)
        self.live = 0
        self.free_ids = list(range(size))
        self.warned = False  # about a thread the OS refused
        #: The thread running each task now, its worker id, and when the task started.
        self.running: dict[Future[Any], tuple[threading.Thread, int, float]] = {}
        #: Threads :meth:`abandon` stopped counting: each ends once its task returns.
        self.abandoned: set[threading.Thread] = set()
        #: The epoch's ``dropped`` event of each task submitted with one, until it ends.
        self.epoch_of: dict[Future[Any], threading.Event] = {}
        #: The counted threads, by worker id.
        self.counted: dict[int, threading.Thread] = {}

    def submit(
        self,
        task: Callable[[int], Any],
        future: Future[Any] | None = None,
        *,
        dropped: threading.Event | None = None,
    ) -> Future[Any]:
        """Queue ``task(worker_id)``; return its future (``future``, or a new one).

        ``dropped``: the event set when the task's epoch is let go (see the invariants).
        """
        future = Future() if future is None else future
        with self.lock:
            if _exit.exiting.is_set():  # only exit interrupts a counted thread (see _reclaim)
                self._reclaim()
            self.tasks.append((future, task))
            if dropped is not None:
                self.epoch_of[future] = dropped
            if self.live < self.size:
                self._start_thread(future)
            else:
                self.work.notify()
        return future

    def free_dropped(self) -> None:
        """Abandon dropped epochs' running tasks while queued tasks find no idle thread.

        Asked by a waiter whose task has not started for a while: a dropped epoch's task that
        is only slow, finishing while nothing waits for its place, is not interrupted.
        """
        with self.lock:
            idle = self.live - len(self.running)
            wanted = len(self.tasks) - max(0, idle)
            stale = [f for f in self.running if f in self.epoch_of and self.epoch_of[f].is_set()]
        for each in stale[: max(0, wanted)]:
            self.abandon(each)

    def _reclaim(self) -> None:
        """Count the threads again: those that ended counted give their places back.

        The caller holds ``lock``. A task such a thread had taken and not finished fails. Only
        exit's interrupts end a counted thread so (:meth:`abandon` stops counting one first),
        so :meth:`submit` asks only once the interpreter began to exit: no cost per sample.
        """
        for worker, thread in [(w, t) for w, t in self.counted.items() if not t.is_alive()]:
            del self.counted[worker]
            for future in [f for f, (t, _, _) in self.running.items() if t is thread]:
                self.running.pop(future)
                self.epoch_of.pop(future, None)
                with contextlib.suppress(InvalidStateError):
                    future.set_exception(
                        RuntimeError(f"loading thread {thread.name!r} ended before its task")
                    )
        self.live = len(self.counted)
        self.free_ids = sorted(set(range(self.size)) - set(self.counted))

    def in_flight(self) -> int:
        """Tasks queued or being run now (a thread :meth:`abandon` let go no longer counts)."""
        with self.lock:
            return len(self.tasks) + len(self.running)

    def _start_thread(self, future: Future[Any] | None) -> bool:
        """Start one thread (the caller holds ``lock``, with ``live < size``); True if started.

        ``future``: the task just queued, failed with the OS's error if no thread can run it.
        """
        worker = self.free_ids[0]
        name = f"{self.name}-{worker}"
        thread = threading.Thread(target=self._run, args=(worker,), name=name, daemon=True)
        try:
            track(thread).start()  # interpreter exit waits for it
        except RuntimeError as e:  # the OS refused a thread ("can't start new thread")
            if future is not None:
                self._not_started(future, name, e)
            return False
        self.free_ids.pop(0)
        self.live += 1  # under the lock: the thread cannot end before it is counted
        self.counted[worker] = thread
        return True

    def _not_started(self, future: Future[Any], name: str, error: RuntimeError) -> None:
        """A thread could not be started (the caller holds ``lock``); nothing is counted.

        With threads running, they take the task, and the pool loads with fewer threads (one
        warning). With none, the task fails with the OS's error: its batch raises it, and the
        next batch tries to start a thread again.
        """
        if self.live:
            if not self.warned:
                self.warned = True
                warn(
                    f"nostall: could not start loading thread {name!r} ({error}); loading with "
                    f"the {self.live} running, out of threads={self.size}: lower threads= or "
                    f"the process's other threads",
                    RuntimeWarning,
                )
            return
        self.tasks.pop()  # the task just queued: no thread will run it
        self.epoch_of.pop(future, None)
        add_note(error, f"nostall: raised starting loading thread {name!r}")
        future.set_exception(error)

    def _run(self, worker: int) -> None:
        # Let go between two tasks (at exit, or abandoned as its task returned): it ends.
        with contextlib.suppress(ThreadLetGo):
            self._work(worker)

    def _work(self, worker: int) -> None:
        me = threading.current_thread()
        while True:
            with self.lock:
                if me in self.abandoned:
                    self.abandoned.discard(me)
                    return  # abandoned while it ran a task: no longer counted, takes no more
                if not self.tasks and not _exit.exiting.is_set():
                    self.work.wait(IDLE_S)
                if not self.tasks:
                    self.counted.pop(worker, None)
                    self.live -= 1
                    self.free_ids.append(worker)
                    self.free_ids.sort()
                    return
                future, task = self.tasks.popleft()
                self.running[future] = (me, worker, time.monotonic())
            if future.set_running_or_notify_cancel():
                try:
                    with self.context():
                        result = task(worker)
                    future.set_result(result)
                except BaseException as e:
                    # Interrupted (abandoned) inside set_result, after the result was set.
                    with contextlib.suppress(InvalidStateError):
                        future.set_exception(e)
            with self.lock:
                self.running.pop(future, None)
                self.epoch_of.pop(future, None)

    def abandon(
        self, future: Future[Any] | None = None, *, running_for: float = 0.0
    ) -> list[threading.Thread]:
        """Stop counting the thread running ``future`` (else each running ``running_for`` s).

        For threads stuck in a sample: each is interrupted at its next Python step (see
        ``_exit.interrupt``; a call stuck in C gets it when it returns) and ends there without
        taking another task; its slot goes to a new thread, started at once for the tasks
        queued. Returns the threads abandoned.
        """
        with self.lock:
            if future is not None:
                futures = [future] if future in self.running else []
            else:
                since = time.monotonic() - running_for
                futures = [f for f, (_, _, started) in self.running.items() if started <= since]
            stuck = [self.running.pop(f) for f in futures]
            for thread, worker, _ in stuck:
                self.abandoned.add(thread)
                self.counted.pop(worker, None)
                self.live -= 1
                self.free_ids.append(worker)
            self.free_ids.sort()
            for _ in range(min(len(self.tasks), self.size - self.live)):
                if not self._start_thread(None):
                    break  # the OS refused: the next submit tries again
            # Under the lock: an abandoned thread cannot end (it needs the lock to) before
            # its interrupt is sent, so the interrupt cannot reach another thread.
            for thread, _, _ in stuck:
                _exit.interrupt(thread)
        return [thread for thread, _, _ in stuck]


class SampleFuture(Future[Any]):
    """The future of one sample, which knows the sample it loads (for messages)."""

    def __init__(self, index: Any) -> None:
        super().__init__()
        self.sample = f"dataset[{short(index)}]"
