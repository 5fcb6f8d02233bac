"""A prefetcher is a drop-in for its loader: the loader's attributes, read and set through it.

Frameworks and training loops read ``loader.dataset``, ``loader.sampler``, ``len(loader)``,
and some set attributes on the loader they were given; a prefetcher passed in the loader's
place forwards both to the source it wraps.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

#: The prefetcher's own attributes; any other name the source has is set on the source (a
#: framework's ``loader._iterator = None`` after shutting its workers down reaches the loader).
#: ``timeout`` and ``pin_memory`` are not among them: a DataLoader has both, and a framework that
#: rebuilds a loader from the prefetcher's attributes (accelerate's ``skip_first_batches``) must
#: read the loader's values, so the prefetcher keeps its own as ``_timeout`` and ``_pin_memory``.
OWN_ATTRIBUTES = frozenset(
    {"device", "_settings", "_pin_memory", "_source", "_staging", "_lineage", "_recorder"}
    | {"_closed"}
)


#: The modules whose code rebuilds a loader from a prefetcher's attributes, which is refused
#: (see ``nostall._clients.ray`` and ``nostall._clients.accelerate``).
_REBUILDERS = frozenset(
    {
        "ray.train.torch.train_loop_utils",
        "ray.train.v2.torch.train_loop_utils",
        "accelerate.data_loader",
    }
)


class LoaderAttributes:
    """Forwards names not its own to ``self._source``; a base of ``Prefetcher``.

    Invariants:
        * A name the prefetcher does not define is read from the source (after
          :meth:`_resolve_shard`: once sharded, from the sharded copy).
        * A name the source has and the prefetcher does not own is set on the source, never
          shadowed on the prefetcher, and :meth:`_source_attribute_set` is told.
    """

    _source: Iterable[Any]

    def _resolve_shard(self) -> None:
        """Before the source is read: let ``shard=True`` put its sharded copy in place."""

    def _source_attribute_set(self) -> None:
        """An attribute was set on the source: what was fetched with the old value is stale."""

    def __len__(self) -> int:
        self._resolve_shard()
        return len(self._source)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found on the Prefetcher: forward them to the source, as a
        # drop-in replacement for a DataLoader must (dataset, sampler, batch_size, ...).
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if "_source" not in self.__dict__:
            raise AttributeError(name)
        if any(name in sys.modules for name in _REBUILDERS):  # three lookups where none is
            from ._clients import accelerate, ray

            reader = sys._getframe(1)  # a framework rebuilding the loader from these attributes
            ray.refuse_rebuild(reader)
            accelerate.refuse_rebuild(reader)
        self._resolve_shard()
        return getattr(self.__dict__["_source"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # A loader attribute set on the prefetcher must not shadow the loader's own value while
        # batches keep coming from the loader: it is set on the loader (which may refuse, as a
        # DataLoader refuses batch_size), and an epoch opened ahead with the old value is
        # dropped. The prefetcher's own attributes, and new names, stay on the prefetcher.
        source = self.__dict__.get("_source")
        if (
            source is None
            or name.startswith("__")
            or name in OWN_ATTRIBUTES
            or name in self.__dict__
            or hasattr(type(self), name)
            or not hasattr(source, name)
        ):
            object.__setattr__(self, name, value)
            return
        setattr(source, name, value)
        self._source_attribute_set()
