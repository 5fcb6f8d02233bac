"""The DataLoader internals nostall relies on, in one place, each with why.

A DataLoader iterates its ``_index_sampler`` (the batch sampler, or the sampler without
automatic batching, ``_auto_collation``); ``threads=`` iterates it the same way. A DataLoader
with ``persistent_workers=True`` keeps its live iterator (its worker processes) in
the private ``_iterator`` attribute; and a DataLoader refuses ``sampler`` and ``batch_sampler``
once built (its ``__setattr__`` checks a private flag). nostall reads the first to tell a fresh
epoch from a resumed one, and sets samplers on a private copy of the loader (resume, sharding).
Both were checked against the torch versions in :data:`CHECKED_TORCH`;
``tests/test_torch_compat.py`` fails on any other version until they are checked again.
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

from torch.utils.data import DataLoader

#: The torch releases (major.minor) whose DataLoader internals these functions were checked on.
CHECKED_TORCH = ("2.13",)

L = TypeVar("L", bound=DataLoader[Any])


def live_iterator(loader: object) -> object | None:
    """The iterator a persistent-workers DataLoader keeps between epochs (None if none)."""
    return getattr(loader, "_iterator", None)


def copy_loader(loader: L, **attributes: Any) -> L:
    """A shallow copy of ``loader`` with ``attributes`` (e.g. ``sampler=...``) set on it.

    The copy has no live iterator: the original's worker processes stay with the original.
    Attributes a built DataLoader refuses (``sampler``, ``batch_sampler``) are set anyway: the
    copy is private and not iterated yet, which is when DataLoader allows them.
    """
    clone = copy.copy(loader)
    clone._iterator = None
    for name, value in attributes.items():
        object.__setattr__(clone, name, value)
    return clone


def index_sampler(loader: DataLoader[Any]) -> Any:
    """What the loader's iterator draws indices from: batches of them, or one per sample."""
    return loader._index_sampler


def auto_collation(loader: DataLoader[Any]) -> bool:
    """Whether the loader fetches batches of indices and collates them (``batch_size`` set)."""
    return bool(loader._auto_collation)
