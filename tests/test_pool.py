"""The pool of loading threads: tasks in order, threads started on demand, the OS refusing one.

What loading through the pool gives (batches, order, errors, threads left behind) is tested
through ``threads=`` in test_threads.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from helpers import refused_thread_starts, wait_until

import nostall._loading.pool as pool_module
from nostall import _exit
from nostall._exit import interrupt
from nostall._loading.pool import Pool


def test_pool_task_without_a_thread_gets_the_os_error() -> None:
    """A task no thread can run fails with the OS's error; the next submit starts a thread."""
    pool = Pool(2, "nostall-load-test")
    with refused_thread_starts("nostall-load-test"):
        failed = pool.submit(lambda worker: worker)
    assert isinstance(failed.exception(timeout=30), RuntimeError)
    assert 0 == pool.live
    assert 7 == pool.submit(lambda worker: 7).result(timeout=30)


def test_at_most_size_tasks_run_at_once_and_the_rest_wait_in_order() -> None:
    """Two threads, five tasks: two run, three wait in submission order; each worker id once."""
    pool = Pool(2, "nostall-load-test")
    release = threading.Event()
    running: list[int] = []

    def task(number: int) -> Callable[[int], int]:
        def run(worker: int) -> int:
            running.append(worker)
            assert release.wait(timeout=60), "never released"
            return number

        return run

    futures = [pool.submit(task(n)) for n in range(5)]
    wait_until(lambda: 2 == len(running), "two tasks running")
    with pool.lock:
        assert [0, 1] == sorted(running)  # each running thread its own worker id
        assert (2, []) == (pool.live, pool.free_ids)  # live + len(free_ids) == size
        queued = [future for future, _ in pool.tasks]
    assert futures[2:] == queued
    release.set()
    assert [0, 1, 2, 3, 4] == [future.result(timeout=60) for future in futures]
    wait_until(lambda: 0 == pool.live, "the idle threads ended")
    assert [0, 1] == pool.free_ids


def test_in_flight_counts_the_tasks_queued_and_running() -> None:
    """One thread, three tasks: all three in flight (one running, two queued), then none."""
    pool = Pool(1, "nostall-load-test")
    release = threading.Event()
    started = threading.Event()

    def run(worker: int) -> int:
        started.set()
        assert release.wait(timeout=60), "never released"
        return worker

    futures = [pool.submit(run) for _ in range(3)]
    assert started.wait(timeout=60), "no task started"
    assert 3 == pool.in_flight()
    release.set()
    assert [0, 0, 0] == [future.result(timeout=60) for future in futures]
    wait_until(lambda: 0 == pool.in_flight(), "no task in flight")


def test_a_thread_ended_by_an_interrupt_gives_its_place_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Interrupted while idle (as exit interrupts it): the next task still gets a thread."""
    # Idle 2 s: the interrupt lands as its wait for work returns, before it would end.
    monkeypatch.setattr(pool_module, "IDLE_S", 2.0)
    pool = Pool(1, "nostall-test")
    assert 1 == pool.submit(lambda worker: 1).result(timeout=30)
    (thread,) = pool.counted.values()
    wait_until(lambda: not pool.running, "the task's end counted")
    assert interrupt(thread)
    thread.join(30)
    assert not thread.is_alive()
    exiting = threading.Event()
    exiting.set()  # as after nostall's exit hook, where an exit handler of the user's loads
    monkeypatch.setattr(_exit, "exiting", exiting)
    assert 2 == pool.submit(lambda worker: 2).result(timeout=30)
