"""What a source's sampler says and does about epochs: ``set_epoch``, its epoch, generators.

Read through a ``DataLoader`` (its sampler, batch sampler and generator), Lightning Fabric's
loader, or any object with a ``set_epoch``: the targets a ``set_epoch`` reaches, the epoch
marks that show someone set it, the generators an order is drawn from and their states.
"""

from __future__ import annotations

from typing import Any

import torch

from .sources import classify


def set_epoch_targets(source: object) -> list[object]:
    """Where ``set_epoch`` may live, in the order it is looked for."""
    batch_sampler = getattr(source, "batch_sampler", None)
    return [
        source,
        getattr(source, "sampler", None),
        batch_sampler,
        getattr(batch_sampler, "sampler", None),
        getattr(source, "dataset", None),
    ]


def forward_set_epoch(source: object, epoch: int) -> bool:
    """Call ``set_epoch(epoch)`` on the first of :func:`set_epoch_targets` that has it."""
    for target in set_epoch_targets(source):
        method = getattr(target, "set_epoch", None)
        if callable(method):
            method(epoch)
            return True
    return False


def _samplers(source: object) -> dict[str, object]:
    batch_sampler = getattr(source, "batch_sampler", None)
    found = {
        "sampler": getattr(source, "sampler", None),
        "batch_sampler": batch_sampler,
        "batch_sampler.sampler": getattr(batch_sampler, "sampler", None),
    }
    return {k: v for k, v in found.items() if v is not None}


def generators_of(source: object) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` an epoch's order may be drawn from, by where it was found."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    candidates = {"loader": source, **_samplers(source)}
    for name, owner in candidates.items():
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[name] = generator
    return found


def capture_rng(source: object) -> dict[str, torch.Tensor]:
    """The states of the global CPU generator and of the source's own generators."""
    states = {"torch": torch.get_rng_state()}
    states.update({name: g.get_state() for name, g in generators_of(source).items()})
    return states


def sampler_epoch_of(source: object) -> int | None:
    for sampler in _samplers(source).values():
        epoch = getattr(sampler, "epoch", None)
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            return epoch
    return None


def epoch_marks(source: object) -> tuple[tuple[str, int], ...]:
    """The ``epoch`` attributes of the objects ``set_epoch`` may reach, where they have one.

    Compared before and after, they show a ``set_epoch`` made directly on the sampler (as
    Lightning does, through ``loader.sampler``) that nostall did not make.
    """
    names = ("source", "sampler", "batch_sampler", "batch_sampler.sampler", "dataset")
    marks = []
    for name, target in zip(names, set_epoch_targets(source), strict=True):
        epoch = getattr(target, "epoch", None) if target is not None else None
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            marks.append((name, epoch))
    return tuple(marks)


def readable_epoch(source: object) -> int | None:
    """The epoch the source's sampler (or dataset) says it is in, when it says one."""
    for _, epoch in epoch_marks(source):
        return epoch
    return None


def has_unreadable_set_epoch(source: object) -> bool:
    """True when ``set_epoch`` reaches an object that keeps no readable ``epoch`` attribute."""
    targets = set_epoch_targets(source)
    if classify(source).mirrored:
        targets = targets[1:]  # accelerate's loaders only pass set_epoch on to these
    return not epoch_marks(source) and any(callable(getattr(t, "set_epoch", None)) for t in targets)


def describe_order(source: object) -> dict[str, Any]:
    """What a saved state must match: the source's length and its samplers' types."""
    try:
        length: int | None = len(source)  # type: ignore[arg-type]
    except TypeError:
        length = None
    return {
        "length": length,
        "samplers": {k: type(v).__qualname__ for k, v in _samplers(source).items()},
    }
