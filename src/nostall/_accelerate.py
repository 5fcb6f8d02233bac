"""Hugging Face accelerate's prepared loaders, iterated ahead without moving its gradient state.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard``. Iterating it has side effects
that ``accelerator.accumulate()`` and ``gather_for_metrics()`` read on the training thread:
``begin()`` registers the shard as the active loader of the process-wide ``GradientState``,
``end_of_dataloader`` turns True just before the last batch is yielded, ``remainder`` counts the
real samples of the last batch, ``iteration`` (its epoch) grows at the end, ``end()``
unregisters it, and a stateful shard keeps ``dl_state_dict``. A prefetcher that iterated the
shard itself would fire them all up to ``depth`` batches early: ``sync_gradients`` would turn
True at the wrong step.

So nostall iterates a *shadow*: a second ``DataLoaderShard`` object sharing the real one's
loader, sampler and settings, whose gradient state is a private stand-in. What the shadow's
iteration did is recorded with each batch (:meth:`ShardMirror.after_pull`, producer side) and
applied to the real shard when that batch is handed out (:meth:`ShardMirror.hand_out`, consumer
side), in the order and at the steps plain accelerate would have applied it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple


class _DetachedGradientState:
    """Stands in for accelerate's ``GradientState`` inside the shadow: its calls change nothing."""

    def _add_dataloader(self, dataloader: object) -> None:
        pass

    def _remove_dataloader(self, dataloader: object) -> None:
        pass


class ShardEffects(NamedTuple):
    """What the shadow's iteration had done right after one pull."""

    end_of_dataloader: bool
    remainder: int
    iteration: int
    dl_state_dict: Any


def is_prepared_shard(source: object) -> bool:
    """True for a loader ``accelerator.prepare`` returned (``DataLoaderShard``)."""
    module = sys.modules.get("accelerate.data_loader")
    shard_type = getattr(module, "DataLoaderShard", None)
    return shard_type is not None and type(source) is shard_type


def is_dispatcher(source: object) -> bool:
    """True for accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``)."""
    module = sys.modules.get("accelerate.data_loader")
    dispatcher_type = getattr(module, "DataLoaderDispatcher", None)
    return dispatcher_type is not None and type(source) is dispatcher_type


def accelerate_is_active() -> bool:
    """True once an ``Accelerator`` (or accelerate's ``PartialState``) was created here."""
    module = sys.modules.get("accelerate.state")
    state = getattr(module, "PartialState", None)
    shared = getattr(state, "_shared_state", None)
    return bool(shared)


def prepared_loader_types() -> tuple[type, ...]:
    """The loader classes accelerate's ``prepare`` returns (empty when it is not imported)."""
    module = sys.modules.get("accelerate.data_loader")
    names = ("DataLoaderShard", "DataLoaderDispatcher")
    return tuple(t for t in (getattr(module, n, None) for n in names) if isinstance(t, type))


#: Modules that hold accelerate's ``skip_first_batches`` under that name: accelerate's own, and
#: Hugging Face ``Trainer``'s, which calls it to resume mid-epoch.
_SKIP_HOLDERS = ("accelerate", "accelerate.data_loader", "accelerate.accelerator", "transformers.trainer")


def route_skip_first_batches(
    kind: type, rebuild: Callable[[Any, Callable[[Any], Any]], Any]
) -> None:
    """Make accelerate's ``skip_first_batches`` skip a prefetcher's source, and prefetch that.

    ``skip_first_batches(loader, n)`` (Trainer's mid-epoch resume, ``accelerator.
    skip_first_batches``) builds a new loader from the attributes of the object it is given.
    Given a prefetcher (``kind``), it would build a plain ``DataLoader`` from attributes read
    through it: no longer accelerate's shard, no longer prefetched. Routed, it is given the
    prefetcher's source instead, and ``rebuild(prefetcher, skip)`` returns a prefetcher like the
    given one over ``skip(source)``: the batches plain accelerate skips to, still prefetched.
    Anything else goes to accelerate's function unchanged. Done once per holding module that is
    imported when a prefetcher is made (Trainer imports accelerate's function before that).
    """
    for name in _SKIP_HOLDERS:
        module = sys.modules.get(name)
        original = getattr(module, "skip_first_batches", None)
        if not callable(original) or hasattr(original, "__nostall_routed__"):
            continue
        setattr(module, "skip_first_batches", _routed(original, kind, rebuild))


def _routed(
    original: Callable[..., Any], kind: type, rebuild: Callable[[Any, Callable[[Any], Any]], Any]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        if isinstance(dataloader, kind):
            return rebuild(dataloader, lambda source: original(source, num_batches))
        return original(dataloader, num_batches)

    skip_first_batches.__nostall_routed__ = original  # type: ignore[attr-defined]
    return skip_first_batches


class ShardMirror:
    """Iterates a shadow of a ``DataLoaderShard`` and replays its effects on the real one.

    Invariants:
        * Only the producer side (whichever thread pulls) iterates the shadow; only the
          consumer thread touches the real shard and accelerate's ``GradientState``.
        * When batch k of an epoch is handed out, the real shard shows what plain accelerate
          shows while the loop body of batch k runs: registered as the active loader, with the
          shadow's ``end_of_dataloader``, ``remainder`` and ``dl_state_dict`` as they were when
          batch k was pulled. When the epoch's end is handed out, its ``iteration`` is advanced
          and it is unregistered, as the end of plain accelerate's ``__iter__`` does.
    """

    def __init__(self, shard: Any) -> None:
        self.shard = shard
        shadow = object.__new__(type(shard))
        shadow.__dict__.update(shard.__dict__)
        shadow.gradient_state = _DetachedGradientState()
        self.shadow = shadow
        self.stateful = bool(getattr(shard, "use_stateful_dataloader", False))
        self._begun = False  # the real shard was registered for the epoch being handed out

    def sync_epoch(self) -> None:
        """Before the consumer opens an epoch: the shadow starts from the real shard's epoch."""
        self.shadow.iteration = self.shard.iteration

    def after_pull(self, end: bool) -> ShardEffects:
        """Producer side: what the shadow shows right after a batch (or the end) was pulled."""
        shadow = self.shadow
        state = getattr(shadow, "dl_state_dict", None) if self.stateful else None
        return ShardEffects(
            bool(shadow.end_of_dataloader), int(shadow.remainder), int(shadow.iteration), state
        )

    def hand_out(self, effects: ShardEffects | None, end: bool) -> None:
        """Consumer side: make the real shard show what it would at this point of the loop."""
        shard = self.shard
        if not self._begun:
            shard.begin()  # registers it with GradientState and computes its remainder
            self._begun = True
        if effects is None:
            return
        if end:
            shard.iteration = effects.iteration
            shard.end()
            self._begun = False
            return
        shard.end_of_dataloader = effects.end_of_dataloader
        shard.remainder = effects.remainder
        if effects.dl_state_dict is not None:
            shard.dl_state_dict = effects.dl_state_dict

    def abandon(self) -> None:
        """The epoch being handed out was left early (as a ``break`` leaves plain accelerate)."""
        self._begun = False
