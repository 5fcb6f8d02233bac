"""Lightning's trainer fetching batches ahead of its step, for a loader without a length.

Lightning's training loop takes batches through a ``_PrefetchDataFetcher``. When the loader has
a length it takes exactly that many, one per step. When it has none (an ``IterableDataset``, a
generator), the fetcher takes one batch ahead of the step, to know whether the batch it gives
the step is the last: at every checkpoint Lightning has taken one batch more from the loader
than the model has trained on. A state that counts the batches the loader handed out would
then resume after a batch the model never saw.

nostall finds the fetcher that iterates a prefetcher (on the stack of the ``iter()`` call,
which the fetcher makes) and, when a state is saved, counts the batches the fetcher still holds
as not handed out (:func:`held_ahead`). Where the state cannot be moved back (the source keeps
its own state, or a transform does), the prefetcher warns instead.

Everything nostall knows about Lightning's loop is in this module; nothing here imports
Lightning (a fetcher is recognised only when Lightning was imported by the user).
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

from .._warn import warn

_FETCHERS = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")

#: How many frames above ``iter(prefetcher)`` the fetcher's own ``__iter__`` may be (it calls
#: ``iter()`` on Lightning's ``CombinedLoader``, which calls it on each of its loaders).
_FRAMES = 12


def iterating_fetcher() -> weakref.ref[Any] | None:
    """A weak reference to Lightning's fetcher if one is calling ``iter()`` now, else None.

    Looked for on the calling thread's stack: a frame running one of the fetcher's own
    ``__iter__``/``__next__`` holds it as ``self``. Frames are matched by their code first:
    reading a frame's ``f_locals`` keeps a snapshot of its locals alive with the frame, which
    must never happen to the user's frames (it would keep a dropped prefetcher alive).
    """
    classes = tuple(
        cls
        for name in _FETCHERS
        if isinstance(cls := getattr(sys.modules.get(name), "_PrefetchDataFetcher", None), type)
    )
    if not classes:
        return None
    codes = {
        method.__code__
        for cls in classes
        for base in cls.__mro__
        for name in ("__iter__", "__next__")
        if callable(method := base.__dict__.get(name)) and hasattr(method, "__code__")
    }
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        # Its __iter__ at an epoch's start; its __next__ where a CombinedLoader cycling a
        # shorter loader (max_size_cycle) calls iter() on it again.
        if frame.f_code in codes:
            fetcher = frame.f_locals.get("self")
            if isinstance(fetcher, classes):
                return weakref.ref(fetcher)
        frame = frame.f_back
    return None


def held_ahead(fetcher: weakref.ref[Any] | None) -> int:
    """Batches the fetcher took from the loader and has not given to the step yet.

    Only a fetcher that fetches ahead: one over a loader without a length. It fetches across
    all its loaders at once; nostall's prefetcher is one of them, so each batch it holds holds
    one of the prefetcher's.
    """
    held = None if fetcher is None else fetcher()
    if held is None or getattr(held, "length", None) is not None:
        return 0
    batches = getattr(held, "batches", None)
    return len(batches) if isinstance(batches, list) else 0


def warn_counted_ahead(source: str, held: int, stateful: bool) -> None:
    """A state saved now counts ``held`` batches the step has not trained on, and must."""
    why = "keeps its own state" if stateful else "goes through a transform that keeps a state"
    warn(
        f"nostall: state_dict() counts {held} batch(es) that Lightning's loop fetched ahead of "
        f"its step (it does so for a loader without len()) and the model has not trained on: "
        f"a run resumed from this state skips them. They cannot be left out here, because "
        f"{source} {why}. Give the dataset a __len__ (its samples per epoch) so that Lightning "
        f"takes one batch per step, or save checkpoints at epoch ends",
        UserWarning,
    )
