"""Where a thread is stuck: the line of the user's code it runs, and the sample it loads.

Read from the thread's current stack (``sys._current_frames``), for messages only: a timeout
names the sample that has not returned and the line it waits at, not only "the producer is
busy".
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NamedTuple

import torch

#: nostall's and torch's folders: the machinery around the user's code.
_OURS = tuple(os.path.dirname(path) + os.sep for path in (__file__, torch.__file__) if path)
#: The standard library's folder (packages may be installed beneath it, in site-packages).
_STDLIB = os.path.dirname(threading.__file__) + os.sep


def _machinery(filename: str) -> bool:
    """Whether code in ``filename`` is around the user's code, never where it is stuck."""
    if filename.startswith(_OURS):
        return True
    installed = "site-packages" in filename or "dist-packages" in filename
    return filename.startswith(_STDLIB) and not installed


#: Methods whose first argument (after ``self``) is the sample being loaded.
_LOADS = ("__getitem__", "__getitems__")


class Stuck(NamedTuple):
    """Where a thread is: the sample it loads and the line of the user's code it runs."""

    sample: str = ""  # 'dataset[5]': the innermost __getitem__/__getitems__ on its stack
    line: str = ""  # 'data.py:12 in __getitem__': its innermost frame of the user's code

    def __str__(self) -> str:
        return " at ".join(part for part in self if part)


def stuck_at(thread: threading.Thread | None) -> Stuck:
    """Where ``thread`` is now (empty fields for what cannot be read).

    The user's code is what lies outside nostall, torch and the standard library.
    """
    if thread is None or thread.ident is None:
        return Stuck()
    frame = sys._current_frames().get(thread.ident)
    line, sample = "", ""
    while frame is not None and not (line and sample):
        code = frame.f_code
        if not line and not _machinery(code.co_filename):
            line = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        if not sample and code.co_name in _LOADS and code.co_argcount >= 2:
            sample = f"dataset[{short(frame.f_locals.get(code.co_varnames[1]))}]"
        frame = frame.f_back
    return Stuck(sample, line)


def short(value: object, most: int = 60) -> str:
    """``repr(value)``, cut to ``most`` characters."""
    text = repr(value)
    return text if len(text) <= most else text[: most - 3] + "..."
