"""Lightning Fabric's loader under nostall: ``nostall.prefetch(fabric.setup_dataloaders(loader))``.

Fabric wraps a DataLoader in a ``_FabricDataLoader`` that, at each ``iter()``, sets its
sampler's epoch to its own count of ``iter()`` calls (``_num_iter_calls``), overwriting any
``set_epoch`` made before. That count starts at 0 with every new loader, so in a resumed
process it would draw epoch 0's order for whichever epoch is resumed. The count is therefore
part of what an epoch's order is drawn from: nostall records it with the random states
(:data:`COUNT`), and sets it back before it draws a recorded order again. To resume inside an
epoch, a copy of Fabric's loader over a copy of its DataLoader skips the batches already seen
through the sampler, as over a plain DataLoader: Fabric's own iteration, nothing loaded.

Everything nostall knows about Fabric is in this module; nothing here imports Fabric (a loader
is recognised only when Fabric was imported by the user).
"""

from __future__ import annotations

import sys
from typing import Any

#: The key of Fabric's ``iter()`` count in a state's ``replay`` (and in its ``end_of``).
COUNT = "fabric_iter_calls"

_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")


def is_fabric_loader(source: object) -> bool:
    """Whether ``source`` is what ``fabric.setup_dataloaders`` returned: a ``_FabricDataLoader``."""
    for name in _WRAPPERS:
        cls = getattr(sys.modules.get(name), "_FabricDataLoader", None)
        if isinstance(cls, type) and isinstance(source, cls):
            return True
    return False


def fabric_device(source: object) -> Any:
    """The device Fabric moves ``source``'s batches to, or None (not Fabric's, or no move).

    A prefetcher over Fabric's loader with no ``device=`` goes there, not to CUDA whenever
    there is one: ``Fabric(accelerator="cpu")`` on a GPU machine trains on the CPU.
    """
    return getattr(source, "device", None) if is_fabric_loader(source) else None


def fabric_inner_loader(source: object) -> Any:
    """The DataLoader inside Fabric's loader ``source``, or None when it is not one."""
    return source._dataloader if is_fabric_loader(source) else None  # type: ignore[attr-defined]


def fabric_over(loader: Any, dataloader: Any) -> Any:
    """A Fabric loader like ``loader`` (same class and device) over ``dataloader`` instead.

    Its ``iter()`` sets the sampler's epoch from ``loader``'s count, as ``loader``'s next
    ``iter()`` would; ``loader``'s count moves on by one, as if that ``iter()`` was its own.
    """
    shadow = type(loader)(dataloader, loader.device)
    shadow._num_iter_calls = loader._num_iter_calls
    loader._num_iter_calls += 1
    return shadow


class IterCount:
    """The count of ``iter()`` calls from which a Fabric loader sets its sampler's epoch.

    Invariant: the count recorded with an epoch (:meth:`drawn`, read before that epoch's
    ``iter()``) is the epoch Fabric sets on the sampler for it, and so the sampler epoch that
    order is recorded with; the next epoch gets one more (:meth:`after`).
    """

    def __init__(self, loader: object) -> None:
        self.loader = loader

    def drawn(self, sampler_epoch: int | None) -> dict[str, Any]:
        """Recorded where an epoch is opened: the count its ``iter()`` is about to use.

        ``sampler_epoch`` is the sampler's epoch now (None: it shows none), which Fabric's
        ``iter()`` replaces with the count.
        """
        count = int(self.loader._num_iter_calls)  # type: ignore[attr-defined]
        return {COUNT: count, "sampler_epoch": None if sampler_epoch is None else count}

    def after(self, drawn: Any, sampler_epoch: int | None) -> dict[str, Any]:
        """Recorded at an epoch's end: the count, and sampler epoch, of the next ``iter()``.

        ``drawn`` is what the ended epoch recorded; when it is not known, the count now (and
        ``sampler_epoch``, the sampler's epoch now, as in :meth:`drawn`).
        """
        if not (isinstance(drawn, dict) and isinstance(drawn.get(COUNT), int)):
            return self.drawn(sampler_epoch)
        count = drawn[COUNT] + 1
        return {COUNT: count, "sampler_epoch": None if drawn["sampler_epoch"] is None else count}

    def restore(self, replay: dict[str, Any]) -> None:
        """Before an order is drawn again: the count it was drawn with, where it was recorded."""
        count = replay.get(COUNT)
        if count is not None:
            self.loader._num_iter_calls = count  # type: ignore[attr-defined]


def check_count(replay: dict[str, Any], where: str = "state['replay']") -> None:
    """Refuse a damaged count in a loaded state (``ValueError`` naming the field).

    ``where`` is the replay record's place in the state (``state['replay']['end_of']``, say).
    """
    count = replay.get(COUNT)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise ValueError(
            f"{where}[{COUNT!r}] must be None or an int >= 0 (got {count!r}); pass a "
            f"state from Prefetcher.state_dict()"
        )


def threads_refusal(threads: int) -> str:
    """Why ``threads=`` cannot load Fabric's loader, and the way that works."""
    return (
        f"nostall.prefetch(threads={threads}) loads a plain DataLoader's samples itself, and "
        f"this is Lightning Fabric's loader (from fabric.setup_dataloaders), which iterates the "
        f"DataLoader in its own way. Pass the DataLoader you gave setup_dataloaders instead: "
        f"nostall.prefetch(loader, fabric.device, threads={threads}, shard=True), where "
        f"shard=True gives each rank its part with the DistributedSampler Fabric would inject, "
        f"and call batches.set_epoch(epoch) before each epoch (Fabric's loader did that for you)"
    )
