"""What a source is, decided in one place: every "is it a DataLoader?" of nostall is asked here.

:func:`classify` looks at a source once, when a prefetcher is built (and again when
``shard=True`` puts a sharded copy in its place), and returns a :class:`SourceKind`. Every
other module asks that value, never the source's type: the engine asks the epoch source built
from it (:class:`~nostall._epochs.epochs.EpochSource`, the adapter), and the argument checks, the
resume, the skipping and the global-draw watch ask the kind. A new client is recognised here
(its recogniser lives in its own module: :mod:`nostall._clients.fabric`,
:mod:`nostall._clients.accelerate`) and adapted in the epoch source; the channel, the producer,
the staging and the iteration do not change.

The kinds, as the checks tell them apart::

    a one-shot iterator (a generator)          one_shot        its items once, then exhausted
      (not one whose __iter__ starts it again: restarts_on_iter)
    a list or tuple of batches                 batches_known   len() counts them
    a torch DataLoader (or a subclass)         loader          its dataset, sampler, workers
      over a map-style dataset                 map_style       len() counts its batches
      iterated by DataLoader.__iter__          torch_iteration threads= may load its samples
    a stateful loader (torchdata's)            stateful        resumes through its own state
    Lightning Fabric's loader                  client=FABRIC   counts iter() calls
    accelerate's prepared loader               client=ACCELERATE  a shard of a DataLoader
    an IterableDataset given as the source     iterable_dataset (webdataset, HF streaming)
    an object that iterates a DataLoader it    held            its sampler, draws, persistent
      holds (timm's PrefetchLoader)                              workers' iterator
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import types
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, IterDataPipe

from .._clients.accelerate import is_dispatcher, is_prepared_shard, prepared_loader_types
from .._clients.fabric import fabric_inner_loader, is_fabric_loader
from .._torch_compat import is_loader_iterator


class Client(enum.Enum):
    """Who built the loader nostall wraps (what its epochs need beyond a plain iteration)."""

    #: Anything iterable: a DataLoader, a list, a generator, a pipeline.
    PLAIN = "plain"
    #: ``fabric.setup_dataloaders``'s ``_FabricDataLoader``: sets the epoch from its count.
    FABRIC = "Lightning Fabric"
    #: ``accelerator.prepare``'s ``DataLoaderShard`` or ``DataLoaderDispatcher``.
    ACCELERATE = "accelerate"


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """What one source is: fixed when it is classified.

    The loader's own settings that a user may still change (``num_workers``,
    ``persistent_workers``) are read from it when asked, not copied.

    Invariants:
        * ``loader`` is the source itself where the source claims to be a DataLoader (a
          subclass, or accelerate's prepared loader, which claims the class), else None;
          ``inner`` is the DataLoader whose dataset and sampler make the batches: ``loader``,
          or the one inside Fabric's loader.
        * ``map_style`` and ``torch_iteration`` are False without ``loader``.
    """

    #: The source itself: the engine opens it through this value, so that what it is and what
    #: is opened never part (a sharded copy is classified anew).
    source: Any = dataclasses.field(compare=False, repr=False)
    #: The source's type, as messages name it.
    name: str
    client: Client
    loader: DataLoader[Any] | None
    inner: DataLoader[Any] | None
    #: The source is its own iterator (a generator, say): it yields its items once.
    one_shot: bool
    #: A list or tuple: ``len()`` counts its batches.
    batches_known: bool
    #: ``type(source)`` is a DataLoader subclass (accelerate's loader only claims the class).
    dataloader_type: bool
    #: The loader's dataset is map-style (not an ``IterableDataset``).
    map_style: bool
    #: Iterated by ``DataLoader.__iter__`` itself, so its samples can be loaded by index.
    torch_iteration: bool
    #: The source keeps its own ``state_dict()``/``load_state_dict()`` (torchdata's loader).
    stateful: bool
    #: The source is an ``IterableDataset`` itself (a webdataset pipeline, HF streaming).
    iterable_dataset: bool
    #: accelerate's ``DataLoaderShard``: iterated through a shadow (``ShardMirror``).
    accelerate_shard: bool
    #: accelerate's ``DataLoaderDispatcher``: rank 0 loads, each batch a collective call (so
    #: refused in a distributed run); on one process, iterated through a shadow as a shard is.
    accelerate_dispatcher: bool
    #: The loader's dataset is a torchdata ``IterDataPipe`` (seeded and sharded by torch's
    #: own iterator, which threads would bypass).
    datapipe: bool
    #: A plain source that is no DataLoader but holds one as an attribute, the only one it
    #: holds (timm's ``PrefetchLoader`` keeps it in ``.loader``): what it iterates, presumably.
    held: DataLoader[Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def workers(self) -> int:
        """The loader's worker processes (0 without a loader)."""
        return 0 if self.loader is None else int(self.loader.num_workers)

    @property
    def persistent(self) -> bool:
        """A loader that keeps its workers, and its iterator, across epochs."""
        return self.workers > 0 and bool(self.loader.persistent_workers)  # type: ignore[union-attr]

    @property
    def held_persistent(self) -> DataLoader[Any] | None:
        """The loader a wrapper holds (``held``) where it keeps its workers across epochs.

        Its first ``iter()`` draws its workers' base seed and its order; each later one only
        its order: a wrapper resumed over a fresh one must start its workers first (see
        ``EpochSource._replay``).
        """
        held = self.held
        if held is None or held.num_workers <= 0 or not held.persistent_workers:
            return None
        return held

    @property
    def map_style_maker(self) -> DataLoader[Any] | None:
        """The DataLoader over a map-style dataset that makes the batches, or None.

        The source itself, or the loader a wrapper holds (``held``): its index sampler says
        when an order is drawn (see ``global_draws.reshuffler``).
        """
        loader = self.loader if self.loader is not None else self.held
        if loader is None or isinstance(loader.dataset, IterableDataset):
            return None
        return loader

    @property
    def restarts_workers(self) -> bool:
        """A loader whose worker processes are started anew at each epoch."""
        return self.workers > 0 and not self.persistent

    @property
    def mirrored(self) -> bool:
        """accelerate's prepared loader, shard or dispatcher: iterated through a shadow.

        Both move accelerate's ``GradientState`` (and keep ``dl_state_dict``) as they are
        iterated, which must happen when a batch is handed out, not when it is pulled.
        """
        return self.accelerate_shard or self.accelerate_dispatcher

    @property
    def counted(self) -> bool:
        """Whether ``len()`` counts the batches an epoch yields (else it is only an estimate).

        A map-style DataLoader (or Fabric's loader over one) yields its batch sampler's
        batches, a list or tuple its items; torch documents the ``len()`` of a loader over an
        ``IterableDataset`` as an estimate, and any other source's is what it says.
        """
        if self.inner is not None:
            return not isinstance(self.inner.dataset, IterableDataset)
        return self.batches_known

    @property
    def skippable(self) -> bool:
        """A DataLoader whose copy may skip batches through its sampler, loading nothing.

        A DataLoader over a map-style dataset, without persistent workers (a copy would make
        its next epoch draw differently), that iterates itself: torch's own ``__iter__``, or a
        subclass's that holds no other loader or loader iterator (Ray Train's prepared loader
        iterates a DataLoader it holds, timm's multi-epochs loader an iterator it keeps across
        epochs: a copy's sampler would reach neither) and whose index sampler has a length.
        """
        if not self.map_style or self.persistent:
            return False
        return self.torch_iteration or (self.dataloader_type and _iterates_itself(self.source))

    @property
    def records_worker_draws(self) -> bool:
        """Whether the draws of the loader's worker processes are recorded, and resumed.

        A ``DataLoader`` with workers, iterated by torch's own ``__iter__`` over a map-style
        dataset, whose workers take its batches in turn (``in_order``, batches of indices):
        see :mod:`nostall._sources.worker_draws`.
        """
        loader = self.loader
        return (
            loader is not None
            and self.torch_iteration
            and self.map_style
            and self.workers > 0
            and loader.batch_sampler is not None
            and bool(getattr(loader, "in_order", True))
        )

    def length(self) -> int | None:
        """``len(source)``: its batches per epoch (or an estimate); None without a length."""
        try:
            return len(self.source)
        except TypeError:
            return None


def restarts_on_iter(source: object) -> bool:
    """Whether ``source``, an iterator, starts again when ``iter()`` is called on it.

    An iterator's ``__iter__`` returns the iterator itself, and a plain ``for`` loop over an
    exhausted one yields nothing. Some loaders are iterators whose ``__iter__`` does more
    before returning itself: Ray Train's prepared ``DataLoader`` makes a new iterator of its
    loader there, so a ``for`` loop gets every epoch anew. Told by what ``__iter__`` is, not by
    calling it: a method of a builtin iterator (a generator, ``map``, a list's iterator) or a
    Python ``return self`` does nothing more; any other Python ``__iter__`` is taken to start
    the iterator again, as a plain loop would find, since nostall calls ``iter()`` each epoch
    as that loop does.
    """
    method = inspect.getattr_static(type(source), "__iter__", None)
    if not isinstance(method, types.FunctionType):
        return False  # a builtin iterator's slot: it returns the iterator itself
    return method.__code__.co_code != _returns_itself.__code__.co_code


def _returns_itself(self: object) -> object:
    return self


def open_epoch(source: Iterable[Any]) -> Iterator[Any]:
    """``iter(source)``: an epoch's iterator, which nostall may pass to ``iter()`` again.

    nostall chains and slices the iterators it opens (to skip batches on resume, to hand
    out a batch pulled ahead), and that calls ``iter()`` on them. An iterator that restarts
    on ``iter()`` (see :func:`restarts_on_iter`) is its own epoch iterator: it is wrapped so
    that only this call starts it, as only the loop's ``for`` does in a plain loop.
    """
    it = iter(source)
    return _Started(it) if it is source and restarts_on_iter(it) else it


class _Started:
    """An iterator that restarts on ``iter()``, once started: ``iter()`` leaves it as it is."""

    __slots__ = ("_it",)

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it

    def __iter__(self) -> _Started:
        return self

    def __next__(self) -> Any:
        return next(self._it)


def classify(source: object) -> SourceKind:
    """Decide what ``source`` is (see the module docstring for the kinds)."""
    loader = source if isinstance(source, DataLoader) else None
    if is_fabric_loader(source):
        client = Client.FABRIC
        inner = fabric_inner_loader(source)
        inner = inner if isinstance(inner, DataLoader) else None
    else:
        client = Client.ACCELERATE if isinstance(source, prepared_loader_types()) else Client.PLAIN
        inner = loader
    map_style = loader is not None and not isinstance(loader.dataset, IterableDataset)
    return SourceKind(
        source=source,
        name=type(source).__qualname__,
        client=client,
        loader=loader,
        inner=inner,
        one_shot=isinstance(source, Iterator) and not restarts_on_iter(source),
        batches_known=type(source) in (list, tuple),
        dataloader_type=issubclass(type(source), DataLoader),
        map_style=map_style,
        torch_iteration=loader is not None
        and issubclass(type(source), DataLoader)
        and type(source).__iter__ is DataLoader.__iter__,  # type: ignore[attr-defined]
        stateful=callable(getattr(source, "state_dict", None))
        and callable(getattr(source, "load_state_dict", None)),
        iterable_dataset=isinstance(source, IterableDataset),
        accelerate_shard=is_prepared_shard(source),
        accelerate_dispatcher=is_dispatcher(source),
        datapipe=loader is not None and isinstance(loader.dataset, IterDataPipe),
        held=held_loader(source) if loader is None and client is Client.PLAIN else None,
    )


def held_loader(source: object) -> DataLoader[Any] | None:
    """The one DataLoader that ``source``'s ``__iter__`` iterates, or None.

    Asked of a plain source that is no DataLoader: a wrapper whose ``__iter__`` iterates a
    DataLoader it keeps (timm's ``PrefetchLoader``, a loader of one's own that normalises or
    moves each batch): the one DataLoader among its instance attributes whose name its class's
    ``__iter__`` reads (one that keeps a loader but iterates cached batches is not one). Not
    a prefetcher (its loader is its own to iterate). Nothing is called.
    """
    try:
        attributes = vars(source)
    except TypeError:  # no __dict__ (a list, a generator, slots)
        return None
    method = inspect.getattr_static(type(source), "__iter__", None)
    code = getattr(method, "__code__", None)
    if code is None or "_lineage" in attributes:  # a builtin's __iter__, or a Prefetcher
        return None
    found = [
        value
        for name, value in attributes.items()
        if isinstance(value, DataLoader) and name in code.co_names
    ]
    return found[0] if len(found) == 1 else None


def _iterates_itself(loader: object) -> bool:
    """Whether a DataLoader subclass with an ``__iter__`` of its own iterates itself.

    As far as can be seen without calling it: it holds no other DataLoader or loader
    iterator among its attributes (its own ``_iterator`` aside), and its index sampler has
    a length (an endless one repeats its passes over one iterator).
    """
    for name, value in vars(loader).items():
        if name != "_iterator" and (isinstance(value, DataLoader) or is_loader_iterator(value)):
            return False
    sampler = getattr(loader, "batch_sampler", None) or getattr(loader, "sampler", None)
    return hasattr(type(sampler), "__len__")


def iterated_loader(source: object) -> object:
    """The object whose live iterator a source's epochs share: the loader a wrapper holds.

    The source itself, except a wrapper that holds one DataLoader its ``__iter__`` iterates
    (see :func:`held_loader`): a plain one, or a DataLoader subclass with an ``__iter__`` of its
    own (Ray Train's prepared loader, whose own ``_iterator`` is a stale copy of its loader's);
    read with ``live_iterator`` (a persistent loader's iterator).
    """
    if is_fabric_loader(source) or isinstance(source, prepared_loader_types()):
        return source
    if isinstance(source, DataLoader) and type(source).__iter__ is DataLoader.__iter__:
        return source
    held = held_loader(source)
    return source if held is None else held
