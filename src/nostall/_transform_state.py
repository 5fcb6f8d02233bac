"""The transform's state contract: what a ``transform=`` needs for a checkpoint to hold it.

A transform is any callable. One that keeps state from batch to batch (a random generator, a
count) is checkpointed with the prefetcher when it keeps both halves of
:class:`StatefulTransform`. Half of it is refused at ``prefetch(...)``, before any batch: a
state saved and never restored, or restored and never saved, would let a resumed run go on
with the transform's state from elsewhere, silently.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class StatefulTransform(Protocol):
    """A transform whose state a ``Prefetcher`` checkpoint holds and a resume restores.

    ``nostall.prefetch(loader, transform=t)`` reads ``t.state_dict()`` right after each batch
    it transforms, so that ``Prefetcher.state_dict()`` holds (under ``"transform"``) the state
    as it was after the last batch handed out, not after the batches transformed ahead. A
    fresh prefetcher's ``load_state_dict`` gives it to ``t.load_state_dict(state)`` before its
    first batch. Every ``nostall.transforms`` transform keeps this contract, as does a
    ``torch.nn.Module``.

    Invariants:
        * ``load_state_dict(state_dict())`` puts the transform back where it was: the next
          batch is transformed as it would have been without the checkpoint.
        * The state is what ``torch.save`` and ``torch.load(weights_only=True)`` carry
          (tensors, numbers, strings, and lists, tuples and dicts of them).
    """

    def __call__(self, batch: Any) -> Any:
        """Return the transformed batch."""

    def state_dict(self) -> Any:
        """The transform's state now."""

    def load_state_dict(self, state: Any) -> Any:
        """Continue from ``state``, a value :meth:`state_dict` returned."""


def stateful(transform: object) -> StatefulTransform | None:
    """``transform`` when it keeps the state contract; ``None`` when it has no state to keep.

    Raises:
        TypeError: ``transform`` has one of ``state_dict()`` and ``load_state_dict()`` only.
    """
    if isinstance(transform, StatefulTransform):
        return transform
    has = {
        name
        for name in ("state_dict", "load_state_dict")
        if callable(getattr(transform, name, None))
    }
    if not has:
        return None
    kind = type(transform).__qualname__
    got = f"(got {transform!r:.60}, a {kind})"
    if has == {"state_dict"}:
        raise TypeError(
            f"transform= has state_dict() but no load_state_dict() {got}: its state would be "
            f"saved in every checkpoint and never restored, so a resumed run would not go on "
            f"from it. Give {kind} a load_state_dict(state) method that restores what "
            f"state_dict() returns (the nostall.transforms.StatefulTransform protocol), or "
            f"remove its state_dict() if it keeps no state"
        )
    raise TypeError(
        f"transform= has load_state_dict() but no state_dict() {got}: no checkpoint would hold "
        f"its state, so a resumed run would start it afresh. Give {kind} a state_dict() method "
        f"that returns what load_state_dict(state) restores (the "
        f"nostall.transforms.StatefulTransform protocol), or remove its load_state_dict() if "
        f"it keeps no state"
    )
