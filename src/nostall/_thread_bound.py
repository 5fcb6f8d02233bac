"""Sources bound to the thread that built them: recognising their error, and saying the fix.

``nostall.prefetch`` calls a ``DataLoader``'s dataset and ``collate_fn`` (with
``num_workers=0``) from its own threads: the producer ``nostall-prefetch-N`` and, with
``threads=``, the loading threads ``nostall-load-N``. An object that a dataset makes in its
``__init__`` and that works only in the thread that made it (an ``sqlite3`` connection, an
asyncio event loop, a ``threading.local`` value) then fails on the batches those threads load,
while the plain loop, which loads in the thread that built the dataset, works. The error is the
user's and reaches them as it is; the note made here says why it happened there and what to do.
"""

from __future__ import annotations

import re

#: What such errors say. sqlite3: "SQLite objects created in a thread can only be used in
#: that same thread"; asyncio: "There is no current event loop in thread '...'"; a
#: threading.local read elsewhere: "'_thread._local' object has no attribute ..."; signal and
#: GUI toolkits: "... only works in main thread".
_SAYS_THREAD = re.compile(
    r"created in a thread|\b(?:same|other|another|different|creating|owning|main) thread\b"
    r"|\bin thread '|_thread\._local",
    re.IGNORECASE,
)

#: What to do, as every message about such a source says it.
FIX = (
    "create that object in the thread that uses it: on first use in __getitem__, one per "
    "thread (threading.local()); an sqlite3 connection that only reads may instead be opened "
    "with sqlite3.connect(..., check_same_thread=False); or load with "
    "DataLoader(num_workers=N), each worker process opening its own on first use"
)


def says_thread_bound(error: BaseException) -> bool:
    """Whether ``error``'s message says something was used outside the thread that made it."""
    try:
        text = str(error)
    except Exception:  # an exception whose __str__ fails says nothing
        return False
    return _SAYS_THREAD.search(text) is not None


def thread_bound_note() -> str:
    """The note added to such an error when nostall's thread met it (see the module)."""
    return (
        "nostall: this error says an object was used outside the thread that made it. "
        "nostall.prefetch loads batches in its own threads ('nostall-prefetch-N'; with "
        "threads=, 'nostall-load-N'), not in the thread that built the dataset, so an object "
        "the dataset made in its __init__ that works only in that thread (an sqlite3 "
        f"connection, an event loop) fails there. To prefetch it, {FIX}"
    )
