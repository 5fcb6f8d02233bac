"""Warnings at the user's line: the one way nostall warns.

``warnings.warn`` reports the frame ``stacklevel`` calls up. Counted by hand, that number is
wrong as soon as a call path gains a frame, and differs between ``nostall.prefetch(...)`` and
``nostall.Prefetcher(...)`` (one frame apart) or between ``p.close()`` and a ``with`` block.
:func:`warn` counts it itself: the warning names the first frame outside the nostall package,
the user's line (or a framework's, where a framework calls nostall).

In a thread nostall started (the producer, the loading threads) no frame is the user's: above
nostall's frames there is only ``threading``'s bootstrap. There the warning names the line in
nostall that raised it, which at least says what nostall was doing. Warnings about a batch are
raised where the consumer takes it instead, when nostall can (:mod:`nostall._staging.cuda`).
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` at the first line outside nostall (see the module's docstring)."""
    warnings.warn(message, category, stacklevel=_stacklevel())


def _stacklevel() -> int:
    """The ``stacklevel`` for :func:`warn`'s ``warnings.warn`` call.

    Level 1 is :func:`warn` itself and level 2 its caller in nostall: the fallback where no
    user frame is on this thread's stack.
    """
    frame: FrameType | None = sys._getframe(2)  # warn's caller
    level = 2
    while frame is not None and _in_nostall(frame):
        frame = frame.f_back
        level += 1
    if frame is None or _module(frame) == "threading":  # a thread nostall started
        return 2
    return level


def _in_nostall(frame: FrameType) -> bool:
    name = _module(frame)
    return name == "nostall" or name.startswith("nostall.")


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))
