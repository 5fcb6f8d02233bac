"""How a prefetcher was asked to work: its settings, one frozen value, checked once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from .. import _arguments as check
from .._device import DeviceLike
from .._loading.threadable import check_threadable
from .._sources.sharding import check_shardable


@dataclasses.dataclass(frozen=True)
class Settings:
    """The arguments of ``nostall.prefetch`` after the source, as passed (see there).

    Invariant: a value that exists was checked against its source (:meth:`checked`); the
    device is kept as passed (``None`` is resolved per source by the prefetcher), so that a
    prefetcher over a rebuilt copy of the source is made with the same value.
    """

    device: DeviceLike = None
    depth: int | Literal["auto"] = 2
    pin_memory: bool | None = None
    timeout: float | None = None
    across_epochs: bool = False
    profile: bool = False
    transform: Callable[[Any], Any] | None = None
    shard: bool | None = None
    threads: int | None = None

    @classmethod
    def checked(cls, source: object, **given: Any) -> Settings:
        """The settings ``given`` for ``source``, each checked (TypeError, ValueError)."""
        settings = cls(**given)
        check.source(source)
        check_threadable(source, settings.threads)
        check.depth(settings.depth)
        check.timeout(settings.timeout)
        check.flag("nostall.prefetch", "pin_memory", settings.pin_memory, optional=True)
        check.flag("nostall.prefetch", "across_epochs", settings.across_epochs)
        check.flag("nostall.prefetch", "profile", settings.profile)
        check.flag("nostall.prefetch", "shard", settings.shard, optional=True)
        if settings.shard:
            check_shardable(source)
        transform = settings.transform
        if transform is not None and not callable(transform):
            raise TypeError(
                f"transform must be callable, e.g. nostall.transforms.Normalize(...) (got "
                f"{transform!r} that is {check.kind(transform)})"
            )
        return settings

    def replace(self, **changes: Any) -> Settings:
        """These settings with ``changes``."""
        return dataclasses.replace(self, **changes)
