"""timm's ``PrefetchLoader`` under nostall: the fix that exists in timm, where one is needed.

timm's training loader is, by default, a ``PrefetchLoader`` around a ``DataLoader``: it takes
each next batch one ahead, copies and normalises it and, with ``re_prob > 0``, erases random
patches, drawing from Python's ``random`` and torch's generator in the thread that iterates it.
Where the step draws from the same generator, nostall must load such a source in step with the
loop (see :mod:`nostall._sources.global_draws`), and the generic fixes (a generator of the
draws' own) are not ones a timm user can apply. timm's own is ``use_prefetcher=False``
(``train.py --no-prefetcher``): normalising and erasing then run in the loader's worker
processes with the other augmentations. Nothing here imports timm.
"""

from __future__ import annotations


def is_timm_prefetch_loader(source: object) -> bool:
    """Whether ``source`` is timm's ``PrefetchLoader`` (recognised by its class, not imported)."""
    cls = type(source)
    return cls.__name__ == "PrefetchLoader" and cls.__module__.split(".")[0] == "timm"


#: The fix named to a user of timm's ``PrefetchLoader`` whose draws keep nostall in step.
TIMM_FIX = (
    "With timm, build the loader with create_loader(..., use_prefetcher=False) (train.py's "
    "--no-prefetcher): its normalising and random erasing then run in the worker processes, "
    "and nostall prefetches and copies the batches"
)
