"""The side streams lent to CUDA stagings, one each, and lent again once a staging is gone."""

from __future__ import annotations

import threading

from nostall._staging.copy_streams import CopyStreams


def test_copy_streams_taken_back_inside_a_take_back_do_not_deadlock() -> None:
    """A take-back inside a take-back (a staging collected meanwhile) does not deadlock.

    The garbage collector may finalise a staging in the thread holding the lock.
    """
    lender = CopyStreams()
    done = threading.Event()

    def nested() -> None:
        with lender._lock:
            lender._take_back(0, "a stream")  # type: ignore[arg-type]
        done.set()

    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(10.0)
    assert 1 == lender.free_count(0)
