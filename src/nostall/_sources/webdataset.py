"""webdataset pipelines: the shuffle stages a resumed run cannot draw again.

nostall resumes a source without its own ``state_dict`` by iterating it again and dropping the
batches already handed out, which is exact only if the new iterator yields the same order. A
webdataset shuffle stage draws its order from a ``random.Random`` of its own, which nostall
neither records nor restores:

* ``.shuffle(n)`` without ``seed=`` or ``rng=`` seeds it from the process id and the time: no
  run, resumed or not, draws its order twice. Resumed mid-epoch, the dropped batches are not
  the ones already trained on: some samples are trained twice in that epoch and others never.
* ``.shuffle(n, rng=random.Random(s))`` and ``detshuffle(n, seed=s)`` draw the same orders in
  every run, but each epoch goes on from where the previous left the generator (or the stage's
  epoch counter). A fresh process starts them over, so epoch e > 0 is drawn as epoch 0 was --
  unless the stage is copied afresh into the DataLoader's worker processes each epoch (workers
  without ``persistent_workers``), where every epoch starts from the same state anyway.
* ``.shuffle(n, seed=s)`` makes a new ``random.Random(s)`` per epoch: the same order each
  epoch, drawn again exactly on resume. ``WebDataset(shardshuffle=n)`` shuffles its shards so.

Only this module knows webdataset's classes; it imports nothing from webdataset unless the
user's program already did (a pipeline cannot exist otherwise).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from typing import Any

from .sources import classify


def unreplayable_shuffles(source: object, epoch: int, handed_out: int) -> list[str]:
    """The shuffle stages in ``source`` whose order a resume at ``epoch`` cannot draw again.

    ``handed_out`` batches of ``epoch`` were received before the state was saved: an unseeded
    shuffle matters only mid-epoch (at an epoch's start no run could draw its order again
    either, and nothing is trained twice).
    """
    filters = sys.modules.get("webdataset.filters")
    if filters is None:
        return []
    found = []
    for stage, copied_per_epoch in _stages(source, copied_per_epoch=False, depth=0):
        if isinstance(stage, filters.FilterFunction) and stage.f is filters._shuffle:
            bound = _shuffle_arguments(stage)
            if bound.get("bufsize", 1000) in (None, False, 0, 1):
                continue  # a buffer of one sample yields the stream as it comes
            if bound.get("seed") is not None:
                continue
            if bound.get("rng") is None:
                if handed_out > 0:
                    found.append(f"{_describe(stage)} (seeded from the process id and the time)")
            elif epoch > 0 and not copied_per_epoch:
                found.append(f"{_describe(stage)} (its rng goes on from epoch to epoch)")
        elif (
            isinstance(stage, filters.detshuffle)
            and epoch > 0
            and not copied_per_epoch
            and stage.epoch != epoch - 1  # built as detshuffle(..., epoch=epoch - 1): exact
        ):
            found.append(
                f"detshuffle({stage.bufsize}, seed={stage.seed}) (it counts epochs from "
                f"{stage.epoch + 1} in this process)"
            )
    return found


def shuffle_warning(stages: list[str], epoch: int, handed_out: int) -> str:
    """The warning for :func:`unreplayable_shuffles`' findings, with the fix."""
    harm = (
        f"after the {handed_out} batches dropped the model sees other samples than the "
        f"uninterrupted run would: some twice in this epoch and some never"
        if handed_out
        else "the epoch is drawn in another order than the uninterrupted run's"
    )
    return (
        f"nostall: resuming epoch {epoch} of a webdataset pipeline that shuffles with "
        f"{'; '.join(stages)}: the resumed run cannot draw that order again (nostall, like "
        f"any loader, resumes by iterating the source again and dropping the batches already "
        f"handed out), so {harm}. Pass a seed: .shuffle(n, seed=s) draws the same order in "
        f"every run (and every epoch) and resumes exactly; a detshuffle(n, seed=s) resumes "
        f"epoch e exactly when built with epoch=e - 1 in the resumed process"
    )


def _shuffle_arguments(stage: Any) -> dict[str, Any]:
    """``_shuffle``'s arguments as the stage was curried with them, by name."""
    try:
        bound = inspect.signature(stage.f).bind_partial(None, *stage.args, **stage.kw)
        return dict(bound.arguments)
    except TypeError:
        return dict(stage.kw)


def _describe(stage: Any) -> str:
    shown = [repr(a) for a in stage.args] + [f"{k}={v!r}" for k, v in stage.kw.items()]
    return f"shuffle({', '.join(shown)})"


def _stages(source: object, copied_per_epoch: bool, depth: int) -> Iterator[tuple[object, bool]]:
    """Every stage of a pipeline, with whether it runs on a fresh copy each epoch.

    Walks into ``DataLoader.dataset`` (a dataset that worker processes copy at each epoch's
    start unless the workers persist) and into nested pipelines (``WebLoader`` wraps a
    ``DataLoader``).
    """
    if depth > 8:  # pipelines nest a few levels at most; a cycle must not recurse forever
        return
    kind = classify(source)
    if kind.loader is not None:
        fresh = copied_per_epoch or kind.restarts_workers
        yield from _stages(kind.loader.dataset, fresh, depth + 1)
        return
    stages = getattr(source, "pipeline", None)
    if not isinstance(stages, list):
        return
    for stage in stages:
        yield stage, copied_per_epoch
        if classify(stage).loader is not None or isinstance(getattr(stage, "pipeline", None), list):
            yield from _stages(stage, copied_per_epoch, depth + 1)
