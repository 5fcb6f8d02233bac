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


class Counted(int):
    """An epoch that nostall set on a sampler by itself (``across_epochs=True`` counting).

    Equal to the plain int, and an int wherever it is used (a ``DistributedSampler`` seeds
    its shuffle with ``seed + epoch``: a plain int); only its type tells that nobody set the
    epoch since nostall did, since a ``set_epoch`` call stores the plain int it is given. It
    unpickles as a plain int (``torch.load(weights_only=True)`` refuses it all the same: it is
    left on a sampler only around the first epoch boundary, see ``UnaskedEpochWatch``).
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[type[int], tuple[int]]:
        return int, (int(self),)


def forward_set_epoch(source: object, epoch: int, *, counted: bool = False) -> bool:
    """Call ``set_epoch(epoch)`` on the first of :func:`set_epoch_targets` that has it.

    ``counted``: nostall sets it by itself, not asked by the loop; where the target keeps the
    epoch in a plain ``epoch`` attribute it is marked :class:`Counted` (see
    :func:`left_as_counted`), unless it was at that epoch already: set by the loop (an
    Ignite handler at ``EPOCH_STARTED`` runs before the loop asks for the last epoch's end).
    """
    for target in set_epoch_targets(source):
        method = getattr(target, "set_epoch", None)
        if callable(method):
            before = getattr(target, "epoch", None)
            method(epoch)
            asked = type(before) is int and before == epoch
            if counted and not asked and type(getattr(target, "__dict__", {}).get("epoch")) is int:
                # Only a plain instance attribute (not a property) is marked.
                target.epoch = Counted(epoch)  # type: ignore[attr-defined]
            return True
    return False


def unmark(source: object) -> None:
    """Make a :class:`Counted` epoch left on the ``set_epoch`` target a plain int again."""
    target = left_as_counted(source)
    if target is not None:
        target.epoch = int(target.epoch)  # type: ignore[attr-defined]


def left_as_counted(source: object) -> object | None:
    """The object whose epoch nostall set by itself and nobody set since, or None.

    (The first target ``set_epoch`` reaches, where its ``epoch`` is still :class:`Counted`.)
    """
    for target in set_epoch_targets(source):
        if callable(getattr(target, "set_epoch", None)):
            return target if isinstance(getattr(target, "epoch", None), Counted) else None
    return None


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
            return int(epoch)  # a plain int in a state, not a Counted
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
            marks.append((name, int(epoch)))
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
