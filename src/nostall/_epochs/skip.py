"""Skipping the batches of an epoch already handed out, when a state is resumed."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader

from .._clients.fabric import fabric_over
from .._sources.sources import classify, open_epoch
from .._torch_compat import copy_loader


class _SkipFirst:
    """A sampler that drops the first ``count`` items of another, drawing exactly as it does.

    Invariant: ``started()`` is called once the items were dropped and the next one drawn
    (what the sampler draws at its start, and for those items), before that item is given:
    from there on the loader draws for the batches after the skipped ones (their samples).
    ``once``: only the first pass that runs skips (a persistent loader's iterator keeps its
    index sampler for every later epoch, which must be whole); later passes are the sampler's.
    """

    def __init__(
        self, sampler: Iterable[Any], count: int, started: Callable[[], None], once: bool = False
    ) -> None:
        self.sampler, self.count, self.started, self.once = sampler, count, started, once
        self.ran = False

    def __iter__(self) -> Iterator[Any]:
        if self.once and self.ran:
            return iter(self.sampler)
        return self._after(iter(self.sampler))  # iter() where the sampler's own is made

    def _after(self, items: Iterator[Any]) -> Iterator[Any]:
        if self.once and self.ran:  # made before the first pass ran, run after it
            yield from items
            return
        self.ran = True  # when the pass runs: torch's iterator makes one it never runs
        for _ in itertools.islice(items, self.count):
            pass
        first = list(itertools.islice(items, 1))
        self.started()
        yield from first
        yield from items

    def __len__(self) -> int:
        skipped = 0 if self.once and self.ran else self.count
        return max(0, len(self.sampler) - skipped)  # type: ignore[arg-type]


def skip_once(sampler: Iterable[Any], count: int, started: Callable[[], None]) -> _SkipFirst:
    """A sampler that skips ``count`` items in its first pass only (see :class:`_SkipFirst`)."""
    return _SkipFirst(sampler, count, started, once=True)


class TakenAhead:
    """An epoch's iterator whose first batch (``first``) was pulled when it was opened.

    Handing that batch over pulls nothing from the source, so the pull that does is not
    judged for draws (see ``DrawWatch.pull``). Where pulling it raised (``error``: the
    batch's own error, as the uninterrupted epoch raised it there), the first ``next()``
    raises that error and the epoch goes on after it, as a loader's iterator does after a
    batch's error: the error is the batch's, not the epoch's opening.
    """

    def __init__(
        self, first: list[Any], rest: Iterator[Any], error: Exception | None = None
    ) -> None:
        self.items = itertools.chain(first, rest)
        self.error = error

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        error = self.error
        if error is not None:
            self.error = None  # raised once; the next batches follow it
            raise error
        return next(self.items)


def skip_ahead(
    source: Iterable[Any],
    count: int,
    iterate: Callable[[Any, int], Iterator[Any]] = lambda loader, skipped: open_epoch(loader),
    started: Callable[[], None] = lambda: None,
    last_pull: Callable[[], None] = lambda: None,
    workers: tuple[int, Callable[[Any, int], Iterator[Any]], Callable[[Any], Any]] | None = None,
) -> Iterator[Any]:
    """An iterator over ``source`` positioned after its first ``count`` batches.

    A map-style ``DataLoader`` skips through its sampler (nothing is loaded), on a shallow copy
    so that the user's loader is untouched, and so does Fabric's loader over one (a copy of it
    over such a copy: Fabric's own iteration, its count moved on as by an ``iter()``);
    anything else is pulled and dropped. (A loader with persistent workers keeps one iterator,
    and its draws, across epochs: a copy would make its next epoch draw differently, so it is
    pulled too.) ``iterate(loader, skipped)`` makes an epoch's iterator (``threads=``: a
    :class:`~nostall._loading.threads.ThreadedEpoch`). ``started()`` is called once the skipped
    batches (and a sampler's start) drew what they draw, before the next batch's samples load
    (with no batch to skip, never). Where the batches are pulled and dropped, ``last_pull()``
    is called before the last of them is pulled (its pull may take the next batch ahead, as
    timm's ``PrefetchLoader`` does: the resume sets the generators as that pull found them).

    ``workers``: ``(start, iterate, restore)`` where the state recorded the draws of the
    loader's workers (see :mod:`nostall._sources.worker_draws`): its copy skips only
    ``start`` batches (a round's start) with ``restore`` giving it workers at the recorded
    states, opened by that ``iterate``, and the ``count - start`` batches left are loaded and
    dropped, so that each later batch is loaded by its uninterrupted worker.
    """
    if not count:
        started = nothing
    kind = classify(source)
    if workers is not None:
        start, iterate_workers, restore = workers
        clone = _skipping_copy(source, start, started)
        if clone is not None:
            it = iterate_workers(restore(clone), start)
            drop(it, count - start)
            return it
    clone = _skipping_copy(source, count, started)
    if clone is not None:
        return iterate(clone, count)
    inner = kind.inner if kind.loader is None else None  # Fabric's loader over a DataLoader
    if inner is not None:
        clone = _skipping_copy(inner, count, started)
        if clone is not None:
            return iterate(fabric_over(source, clone), count)
    it = iterate(source, 0)
    drop(it, count, last_pull)
    started()
    return it


def drop(it: Iterator[Any], count: int, last_pull: Callable[[], None] = lambda: None) -> None:
    """Pull ``count`` batches from ``it`` and drop them (``last_pull()`` before the last)."""
    for pulled in range(count):
        if pulled == count - 1:
            last_pull()
        try:
            next(it)
        except StopIteration:
            break
        except Exception:
            continue  # a batch that raised was handed out as its error: skip it as well


def nothing() -> None:
    """No batch skipped: nothing to call back."""


def _skipping_copy(
    source: object, count: int, started: Callable[[], None]
) -> DataLoader[Any] | None:
    """A copy of a map-style ``DataLoader`` whose sampler skips ``count`` batches, or None."""
    kind = classify(source)
    if kind.loader is not None and kind.skippable:
        loader = kind.loader
        if loader.batch_sampler is not None:
            return copy_loader(
                loader, batch_sampler=_SkipFirst(loader.batch_sampler, count, started)
            )
        return copy_loader(loader, sampler=_SkipFirst(loader.sampler, count, started))
    return None
