"""Exceptions raised by nostall.

Every nostall exception derives from :class:`NostallError` and from the built-in exception whose
meaning it shares, so existing ``except RuntimeError`` or ``except TimeoutError`` clauses still
catch it::

    Exception
    └── NostallError
        ├── DeviceUnavailableError   (also RuntimeError)  the requested device does not exist here
        ├── PrefetcherClosedError    (also RuntimeError)  iterating after close() or a newer iter()
        ├── ProducerDiedError        (also RuntimeError)  the producer thread ended without a word
        └── PrefetchTimeoutError     (also TimeoutError)  one batch took longer than ``timeout``

Exceptions raised by the user's own source or by moving a batch are not wrapped: the consumer
receives the very same exception object, with a note saying where it happened.
"""

from __future__ import annotations


class NostallError(Exception):
    """Base class of every exception nostall raises itself."""


class DeviceUnavailableError(NostallError, RuntimeError):
    """The requested device is not available on this machine."""


class PrefetcherClosedError(NostallError, RuntimeError):
    """The prefetcher, or this iteration of it, was closed and cannot deliver batches."""


class ProducerDiedError(NostallError, RuntimeError):
    """The producer thread ended without delivering a batch, the end of the epoch, or an error."""


class PrefetchTimeoutError(NostallError, TimeoutError):
    """Waiting for one batch took longer than the prefetcher's ``timeout``."""
