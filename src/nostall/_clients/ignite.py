"""PyTorch-Ignite's ``DeterministicEngine`` resuming over a prefetcher.

Resumed mid-epoch (``trainer.load_state_dict`` with an ``iteration`` inside an epoch), a
``DeterministicEngine`` positions a ``DataLoader`` through its batch sampler, and any other
data by creating an iterator and pulling and dropping that many batches
(``DeterministicEngine._from_iteration``). A prefetcher is other data, so:

* with its state loaded too (the prefetcher in ``Checkpoint``'s ``to_save``), it has resumed
  its epoch after the same batches already, and the engine's pulls would skip them a second
  time: the engine is handed placeholders (None) for them instead, which it drops, and the
  batches after them come as in the uninterrupted run, the epoch's order drawn as it was;
* without it, the engine pulls from the start of an epoch the prefetcher opens afresh: not the
  batches the uninterrupted run trained on, which nostall says (:func:`skip_unloaded`).

Nothing here imports Ignite; the engine is recognised by the code calling ``iter()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import FrameType
from typing import Any

_SKIPPER = ("ignite.engine.deterministic", "_from_iteration")


def engine_skips(caller: FrameType) -> int | None:
    """The batches Ignite's ``DeterministicEngine`` will pull and drop after this ``iter()``.

    ``caller``: the frame that called ``iter()`` on the prefetcher. None where it is not the
    engine's ``_from_iteration`` (whose ``iteration``, once it calls ``iter()``, is the count
    it pulls and drops: the engine's ``state.iteration % len(data)``).
    """
    if (caller.f_globals.get("__name__"), caller.f_code.co_name) != _SKIPPER:
        return None
    count = caller.f_locals.get("iteration")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def skip_unloaded(count: int, loaded: int | None) -> str:
    """What to tell a user whose engine skips ``count`` batches the prefetcher will not skip.

    ``loaded``: the batches the state loaded into the prefetcher skips itself (None: no state
    loaded since it was built).
    """
    if loaded is None:
        why = "whose state was not loaded"
        fix = (
            "put the prefetcher in Checkpoint's to_save (to_save={..., 'batches': prefetcher}) "
            "so that its state is saved and loaded with the engine's"
        )
    else:
        why = f"whose loaded state resumes after {loaded} batches"
        fix = "save and load the prefetcher's state with the engine's, from one checkpoint"
    return (
        f"nostall: Ignite's DeterministicEngine resumes this epoch by pulling and dropping "
        f"{count} batches from a nostall Prefetcher {why}: the batches after them are not "
        f"the ones the uninterrupted run trained on. To resume exactly, {fix}"
    )


class AfterPlaceholders(Iterator[Any]):
    """An iteration whose first ``count`` items are placeholders (None), for the engine to drop.

    Given to the engine's skip in place of the prefetcher's iteration, which already resumed
    after those batches: they are not skipped a second time, and the iteration's position is
    untouched. Anything else is read from the iteration.
    """

    def __init__(self, iteration: Iterator[Any], count: int) -> None:
        self._iteration = iteration
        self._owed = count

    def __iter__(self) -> AfterPlaceholders:
        return self

    def __next__(self) -> Any:
        if self._owed:
            self._owed -= 1
            return None
        return next(self._iteration)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._iteration, name)
