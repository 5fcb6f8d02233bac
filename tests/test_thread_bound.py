"""Recognising an error raised because an object was used outside the thread that made it."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from nostall._thread_bound import says_thread_bound


def _raised_in_another_thread(action: object) -> BaseException:
    """What ``action()`` raises when called in a new thread."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            action()  # type: ignore[operator]
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert raised, "the action did not raise in another thread"
    return raised[0]


def test_sqlite3s_error_is_recognised() -> None:
    """A connection made here, used in another thread: sqlite3.ProgrammingError says so."""
    connection = sqlite3.connect(":memory:")
    error = _raised_in_another_thread(lambda: connection.execute("select 1"))
    assert isinstance(error, sqlite3.ProgrammingError)
    assert says_thread_bound(error)
    connection.close()


def test_a_threading_local_read_in_another_thread_is_recognised() -> None:
    """A value set on a threading.local() here is missing in another thread."""
    local = threading.local()
    local.connection = object()
    error = _raised_in_another_thread(lambda: local.connection)
    assert isinstance(error, AttributeError)
    assert says_thread_bound(error)


def test_asyncios_missing_event_loop_is_recognised() -> None:
    """asyncio.get_event_loop() outside the main thread: no loop there, and it says so."""
    error = _raised_in_another_thread(asyncio.get_event_loop)
    assert isinstance(error, RuntimeError)
    assert says_thread_bound(error)


@pytest.mark.parametrize(
    "error",
    [KeyError(3), RuntimeError("Already borrowed"), ValueError("bad sample"), OSError("threads")],
)
def test_an_error_that_names_no_thread_is_not(error: Exception) -> None:
    """Errors that say nothing about which thread made an object get no thread note."""
    assert not says_thread_bound(error)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def test_an_error_whose_str_fails_is_not() -> None:
    """An exception that cannot be printed says nothing, and the check does not raise."""
    assert not says_thread_bound(Unprintable())
