"""One trial of a loader setting: the loader built with it, and the loop's rate measured.

A :class:`Setting` is one way to build and feed the user's loader; :func:`build` passes the
factory only the settings it accepts; :func:`measure` times the loop with a setting. The search
over settings is :mod:`nostall._tools.tune`'s.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .._prefetcher import prefetch
from .._sources.global_draws import unreported
from ..cuda._timing import synchronize
from ..cuda._transfer import to_device
from ..cuda._tree import batch_size_of

Factory = Callable[..., Iterable[Any]]
Step = Callable[[Any], Any]
Transform = Callable[[Any], Any]

LOADER_KNOBS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


@dataclass(frozen=True)
class Setting:
    """One way to build and feed the loader."""

    num_workers: int | None  # None: the factory's own choice (it takes no num_workers)
    depth: int | None  # None: no nostall.prefetch, batches moved in the loop
    threads: int | None = None  # nostall.prefetch(threads=...) with num_workers=0

    def describe(self) -> str:
        """Plain words, as the doctor prints them."""
        workers = (
            "the factory's num_workers"
            if self.num_workers is None
            else (f"num_workers={self.num_workers}")
        )
        feed = "no prefetcher" if self.depth is None else f"nostall.prefetch depth={self.depth}"
        if self.threads is not None:
            feed += f" threads={self.threads}"
        return f"{workers}, {feed}"


#: The loop as the user runs it now: the factory's own settings, batches moved in the loop.
YOURS = Setting(None, None)


def accepted_knobs(factory: Factory) -> set[str]:
    """Which loader settings ``factory`` takes as keyword arguments."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return set(LOADER_KNOBS)
    names = {p.name for p in parameters}
    return {knob for knob in LOADER_KNOBS if knob in names}


def build(factory: Factory, setting: Setting, device: torch.device) -> Iterable[Any]:
    """The loader for ``setting``, passing only the settings ``factory`` accepts."""
    return factory(**loader_kwargs(factory, setting, device))


def loader_kwargs(factory: Factory, setting: Setting, device: torch.device) -> dict[str, Any]:
    """The keyword arguments :func:`build` passes to ``factory`` for ``setting``.

    Every knob that depends on ``num_workers`` is passed with it, so that the factory's own
    defaults for worker processes never meet ``num_workers=0``: a DataLoader refuses
    ``prefetch_factor`` (anything but None) and ``persistent_workers=True`` without workers,
    and ``make_loader(num_workers=2, prefetch_factor=2, persistent_workers=True)`` is an
    ordinary factory.
    """
    knobs = accepted_knobs(factory)
    kwargs: dict[str, Any] = {}
    if setting.num_workers is not None and "num_workers" in knobs:
        workers = setting.num_workers > 0
        kwargs["num_workers"] = setting.num_workers
        if "persistent_workers" in knobs:
            kwargs["persistent_workers"] = workers
        if "prefetch_factor" in knobs:
            kwargs["prefetch_factor"] = 2 if workers else None
    if "pin_memory" in knobs:
        kwargs["pin_memory"] = device.type == "cuda"
    return kwargs


def measure(
    factory: Factory,
    setting: Setting,
    device: torch.device,
    *,
    batches: int,
    warmup: int = 2,
    step: Step | None = None,
    transform: Transform | None = None,
) -> tuple[float, int]:
    """Samples/s of the loop with ``setting`` (the step included when given), and batches used.

    The first ``warmup`` batches (worker start-up) are pulled but not timed. ``transform`` is
    applied as the user's pipeline applies it: by ``nostall.prefetch(transform=...)``, or in the
    loop after the batch was moved when the setting has no prefetcher.
    """
    loader = build(factory, setting, device)
    feed: Iterable[Any]
    if setting.depth is not None:
        feed = prefetch(
            loader, device, depth=setting.depth, transform=transform, threads=setting.threads
        )
    else:
        moved = (to_device(b, device, non_blocking=device.type == "cuda") for b in loader)
        feed = moved if transform is None else (transform(b) for b in moved)
    it = iter(feed)
    used = 0
    samples = 0
    start = 0.0
    # A source drawing from the global generators is loaded in step, as the user's own
    # prefetcher would load it; tune says so in its result, not with a warning per trial.
    with unreported():
        try:
            for batch in it:
                if step is not None:
                    step(batch)
                used += 1
                if used == warmup:
                    synchronize(device)
                    start = time.perf_counter()
                elif used > warmup:
                    samples += batch_size_of(batch) or 1
                if used >= warmup + batches:
                    break
            synchronize(device)
            elapsed = time.perf_counter() - start
        finally:
            close = getattr(feed, "close", None)
            if callable(close):
                close()
    if used <= warmup or elapsed <= 0:
        return 0.0, used
    return samples / elapsed, used
