"""Hugging Face accelerate's prepared loaders, iterated ahead without moving its gradient state.

``accelerator.prepare(loader)`` returns a ``DataLoaderShard``. Iterating it has side effects
that ``accelerator.accumulate()`` and ``gather_for_metrics()`` read on the training thread:
``begin()`` registers the shard as the active loader of the process-wide ``GradientState``,
``end_of_dataloader`` turns True just before the last batch is yielded, ``remainder`` counts the
real samples of the last batch, ``iteration`` (its epoch) grows at the end, ``end()``
unregisters it, and a stateful shard keeps ``dl_state_dict``. A prefetcher that iterated the
shard itself would fire them all up to ``depth`` batches early: ``sync_gradients`` would turn
True at the wrong step.

On one process, a ``DataLoaderDispatcher`` (accelerate's default over an ``IterableDataset``,
so Trainer's over a streaming train set) has the same effects, set at the same points of its
iteration, and is mirrored the same way. In a distributed run it is refused instead
(:func:`nostall._sources.checks.refuse_unsupported`): each of its batches is a collective call.

So nostall iterates a *shadow*: a second object of the prepared loader's type sharing the real
one's loader, sampler and settings, whose gradient state is a private stand-in. What the shadow's
iteration did is recorded with each batch (:meth:`ShardMirror.after_pull`, producer side) and
applied to the real shard when that batch is handed out (:meth:`ShardMirror.hand_out`, consumer
side), in the order and at the steps plain accelerate would have applied it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NamedTuple

from .transformers import SKIP_FIRST_BATCHES_CALLERS


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


def refuse_rebuild(reader: FrameType) -> None:
    """Raise where accelerate's ``prepare_data_loader`` reads a prefetcher's loader to rebuild it.

    ``reader``: the frame reading an attribute of the loader through the prefetcher.
    ``accelerator.prepare_data_loader(prefetcher)`` (unlike ``accelerator.prepare``, which
    hands back what is not a ``DataLoader``) builds a new ``DataLoaderShard`` over a new
    ``DataLoader`` from those attributes, and the loop would iterate it without nostall. Its
    ``skip_first_batches`` reads them too, on purpose (see ``route_skip_first_batches``): not
    refused.

    Raises:
        TypeError: the reader is ``accelerate.data_loader.prepare_data_loader``, or a function
            it called.
    """
    frames = (reader, reader.f_back)
    if any(f is not None and _code_of(f) == _PREPARE for f in frames):
        raise TypeError(
            "accelerate's prepare_data_loader() was given a nostall Prefetcher: it builds a "
            "new DataLoader from the loader's attributes, and your loop would iterate that "
            "without nostall. Prepare the DataLoader first, then wrap it: "
            "nostall.prefetch(accelerator.prepare(loader))"
        )


#: accelerate's function that rebuilds a loader from its attributes.
_PREPARE = ("accelerate.data_loader", "prepare_data_loader")


def _code_of(frame: FrameType) -> tuple[object, str]:
    return frame.f_globals.get("__name__"), frame.f_code.co_name


def prepared_loader_types() -> tuple[type, ...]:
    """The loader classes accelerate's ``prepare`` returns (empty when it is not imported)."""
    module = sys.modules.get("accelerate.data_loader")
    names = ("DataLoaderShard", "DataLoaderDispatcher")
    return tuple(t for t in (getattr(module, n, None) for n in names) if isinstance(t, type))


#: The modules whose ``skip_first_batches`` is accelerate's: the package, where it is defined,
#: and ``accelerate.accelerator``, whose ``Accelerator.skip_first_batches`` calls it by name.
_SKIP_HOLDERS = ("accelerate", "accelerate.data_loader", "accelerate.accelerator")


def route_skip_first_batches(
    kind: type, rebuild: Callable[[Any, Callable[[Any], Any]], Any]
) -> None:
    """Make accelerate's ``skip_first_batches`` skip a prefetcher's source, and prefetch that.

    ``skip_first_batches(loader, n)`` (``accelerator.skip_first_batches``, and Trainer's
    mid-epoch resume) builds a new loader from the attributes of the object it is given, and
    builds a ``DataLoaderShard`` only from a ``DataLoaderShard``. Given a prefetcher (``kind``),
    it would build a plain ``DataLoader``: one without accelerate's ``set_epoch`` (so, in a new
    process, the first epoch's order where Trainer resumes a later one), not prefetched.
    Reading attributes through the prefetcher cannot fix that, so the function is routed: given
    a prefetcher, accelerate's own function is called on the prefetcher's source (the loader
    plain accelerate would have been given), and ``rebuild(prefetcher, skip)`` returns a
    prefetcher made like the given one over ``skip(source)``. Anything else goes to accelerate's
    function unchanged.

    It is a patch of other libraries' module attributes, done only where nothing else reaches
    the call: accelerate has no hook for it, and Trainer calls it on whatever its
    ``get_train_dataloader`` returned. Called when a prefetcher is made, it routes each holding
    module imported by then (Trainer imports its copy before it can build a loader), once; a
    module imported later gets the routed function from the package.
    """
    if "accelerate" not in sys.modules:
        return
    for name in (*_SKIP_HOLDERS, *SKIP_FIRST_BATCHES_CALLERS):
        module = sys.modules.get(name)
        original = getattr(module, "skip_first_batches", None)
        if not callable(original) or hasattr(original, "__nostall_routed__"):
            continue
        module.skip_first_batches = _routed(original, kind, rebuild)  # type: ignore[union-attr]


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


def unthreadable_shard(shard: Any, base_is_torchs: bool) -> str:
    """Why ``threads=`` cannot load this prepared loader's samples ('' when it can).

    The threads replace the loading of the plain ``DataLoader`` the shard iterates
    (``base_dataloader``); everything accelerate does around it (its look-ahead, device
    placement, gradient state) still runs, as :class:`ShardMirror` runs it.
    ``base_is_torchs``: the shard's ``base_dataloader`` is iterated by ``DataLoader.__iter__``.
    """
    if is_dispatcher(shard):
        return (
            "an accelerate DataLoaderDispatcher loads on rank 0 and sends each batch to the "
            "other ranks; prepare the loader with DataLoaderConfiguration(dispatch_batches="
            "False) (each rank loads its own shard, which threads= can load)"
        )
    if not base_is_torchs:
        base = type(getattr(shard, "base_dataloader", None))
        return (
            f"this prepared loader iterates a {base.__qualname__} (use_stateful_dataloader"
            f"=True), whose state threads would bypass; prepare it without the stateful loader"
        )
    return ""


class _LoadedWith:
    """Stands in for a shard's ``base_dataloader`` in the shadow: its epochs come from ``load``.

    Every attribute is the loader's; only ``iter()`` is ``load(loader)`` (the loading threads).
    """

    def __init__(self, loader: Any, load: Callable[[Any], Iterator[Any]]) -> None:
        self.__dict__["_loader"], self.__dict__["_load"] = loader, load

    def __iter__(self) -> Iterator[Any]:
        epoch: Iterator[Any] = self._load(self._loader)
        return epoch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_loader"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._loader, name, value)


class ShardMirror:
    """Iterates a shadow of a prepared loader and replays its effects on the real one.

    The loader is a ``DataLoaderShard``, or a ``DataLoaderDispatcher`` on one process. Its
    ``dl_state_dict`` is read only where it keeps one (``use_stateful_dataloader=True``).

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

    def load_with(self, load: Callable[[Any], Iterator[Any]]) -> None:
        """Have the shadow's epochs load the shard's ``DataLoader`` with ``load`` (``threads=``).

        The real shard, and what the shadow does around its loader, are unchanged.
        """
        self.shadow.base_dataloader = _LoadedWith(self.shard.base_dataloader, load)

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
