"""Exceptions raised by nostall.

Every nostall exception derives from :class:`NostallError` and from the built-in exception whose
meaning it shares, so existing ``except RuntimeError`` or ``except TimeoutError`` clauses still
catch it::

    Exception
    └── NostallError
        ├── DeviceUnavailableError   (also RuntimeError)  the requested device does not exist here
        ├── PrefetcherClosedError    (also RuntimeError)  iterating after close() or a newer iter()
        ├── ProfilingDisabledError   (also RuntimeError)  report() on a prefetcher not profiling
        ├── ProducerDiedError        (also RuntimeError)  the producer thread ended without a word
        ├── PrefetchTimeoutError     (also TimeoutError)  one batch took longer than ``timeout``
        └── ImageDecodeError         (also ValueError)    an encoded image that no decoder reads

The last two carry what a program needs to react without parsing the message: the batch
waited for, what the producer was doing, its thread's name (and the timeout). They survive
pickling (attributes travel in the exception's ``__dict__``).

Exceptions raised by the user's own source or by moving a batch are not wrapped: the consumer
receives the very same exception object, with a note saying where it happened.
"""

from __future__ import annotations

import contextlib

from ._thread_bound import says_thread_bound, thread_bound_note


class NostallError(Exception):
    """Base class of every exception nostall raises itself."""


class DeviceUnavailableError(NostallError, RuntimeError):
    """The requested device is not available on this machine."""


class PrefetcherClosedError(NostallError, RuntimeError):
    """The prefetcher, or this iteration of it, was closed and cannot deliver batches."""


class ProfilingDisabledError(NostallError, RuntimeError):
    """``report()`` was called on a prefetcher built without ``profile=True``."""


class ProducerDiedError(NostallError, RuntimeError):
    """The producer thread ended without delivering a batch, the end of the epoch, or an error.

    Attributes:
        batch: the index in its epoch of the batch that was waited for.
        phase: what the producer was last seen doing.
        thread: the producer thread's name.
    """

    def __init__(
        self,
        message: str,
        *,
        batch: int | None = None,
        phase: str | None = None,
        thread: str | None = None,
    ) -> None:
        super().__init__(message)
        self.batch, self.phase, self.thread = batch, phase, thread


class PrefetchTimeoutError(NostallError, TimeoutError):
    """Waiting for one batch took longer than the prefetcher's ``timeout``.

    Nothing is lost: the next ``next()`` waits for the same batch again.

    Attributes:
        timeout: the limit, in seconds.
        batch: the index in its epoch of the batch waited for (None while waiting for a previous
            iteration's producer to let go of the source).
        phase: what the producer was doing.
        thread: the producer thread's name.
    """

    def __init__(
        self,
        message: str,
        *,
        timeout: float | None = None,
        batch: int | None = None,
        phase: str | None = None,
        thread: str | None = None,
    ) -> None:
        super().__init__(message)
        self.timeout, self.batch, self.phase, self.thread = timeout, batch, phase, thread


class ImageDecodeError(NostallError, ValueError):
    """An image of a batch could not be decoded, by the device's decoder nor by the CPU's.

    Attributes:
        index: the image's position in its batch.
        name: the name it was read under (its path), or ``''``.
    """

    def __init__(self, message: str, *, index: int | None = None, name: str = "") -> None:
        super().__init__(message)
        self.index, self.name = index, name


class ConfigurationError(NostallError, ValueError):
    """What was configured on the ``nostall`` command line cannot work (private, not exported).

    A ``MODULE:FUNC`` spec that cannot be imported, found or called, a factory that does not
    build an iterable (or builds a loader that cannot be measured: no batches, or one that
    loads only in the thread that built it), a ``--device`` that names no device here, bench
    options the bench refuses. The command line reports these, and only these, as usage
    errors (one line, exit status 2): any other exception, a ``ValueError`` from the user's
    own code included, keeps its traceback. A ``ValueError`` too, so that Python callers of
    the functions that raise it (``load_callable``, ``diagnose``) catch it as they always have.
    """


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (shown under its traceback on Python 3.11+).

    Never raises: an exception that refuses notes (attribute writes refused, ``__notes__`` not a
    list) still reaches the user, itself, only without the note.
    """
    with contextlib.suppress(Exception):
        if hasattr(error, "add_note"):
            error.add_note(note)
            return
        # Python 3.10: keep the note where 3.11+ would, for anyone who looks
        notes = getattr(error, "__notes__", None)
        if isinstance(notes, list):
            notes.append(note)
        else:
            error.__notes__ = [note]  # type: ignore[attr-defined]


def is_noted(error: BaseException) -> bool:
    """Whether ``error`` already carries a note from nostall (it is noted once, where it arose)."""
    notes = getattr(error, "__notes__", None)
    return isinstance(notes, list) and any(
        isinstance(note, str) and note.startswith("nostall:") for note in notes
    )


def noted(error: BaseException, where: str) -> BaseException:
    """``error`` itself, noted with where it happened (it reaches the user unwrapped).

    An error whose message says it was raised outside the thread that made some object (an
    sqlite3 connection made in the dataset's ``__init__``) gets a second note: why nostall's
    threads meet it, and the fix (see :mod:`nostall._thread_bound`).
    """
    add_note(error, f"nostall: {where}; re-raised in the consumer after the batches before it")
    if says_thread_bound(error):
        add_note(error, thread_bound_note())
    return error
