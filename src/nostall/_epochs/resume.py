"""Where a run resumes: the consumer's position, and the checkpoint made from it.

The consumer's position is one value, :class:`Position`. It moves each time a batch (or one
batch's error) is handed out, an epoch ends, an epoch is set, or a state is loaded.
``Prefetcher.state_dict()`` is a function of it and the source (:func:`state_of`);
``Prefetcher.load_state_dict()`` checks a saved dictionary against the source
(:func:`check_state`) and makes the position that resumes from it (:func:`loaded_position`).
Batches fetched ahead never move the position: only what the user received does.

The dictionary, version :data:`STATE_VERSION`::

    {"nostall": 1,
     "epoch": e,                # the epoch to resume
     "batches_yielded": n,      # batches of it the user already received
     "source_state": ...,       # a stateful source's own state_dict() (else None)
     "replay": {...},           # else: what the epoch's order was drawn from (random states,
                                # the sampler's epoch), to draw it again and skip n batches;
                                # across epochs, inside an epoch, also "next_rng": torch's
                                # global generator as the next epoch's order is drawn from it
     "transform": ...}          # a stateful transform's state_dict() (only with one)
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

import torch

from .._arguments import kind, received
from .._clients.fabric import check_count
from .._sources.generators import as_tuples
from .._sources.global_draws import DrawWatch
from .._sources.samplers import describe_order
from .._transform_state import StatefulTransform
from .._warn import warn
from .epochs import AS_BUILT, EpochSource

#: Version of the state format written by ``Prefetcher.state_dict``.
STATE_VERSION = 1


@dataclasses.dataclass(slots=True)
class Position:
    """Where the consumer is: it has received ``handed_out`` batches of ``epoch``.

    Changed only in the consumer thread: in place for each batch handed out (the hot path,
    :meth:`advance`), replaced by a new value at every other move.

    Invariants:
        * ``epoch`` is the epoch the next (or current) iteration yields.
        * ``source_state`` is what resuming right after the last batch handed out needs from
          the source (a stateful source's own ``state_dict()``, else the record to draw the
          epoch's order again), taken where that batch was pulled; or :data:`AS_BUILT`, and
          then ``handed_out`` is 0 or ``loaded`` is set.
        * ``transform_state`` is the transform's ``state_dict()`` after the last batch handed
          out (as built before any); None without a stateful transform.
        * ``loaded`` is the state given to ``load_state_dict()``, until a batch is handed out
          or the epoch is set to another: ``state_dict()`` returns it as it was loaded.
    """

    epoch: int
    handed_out: int
    source_state: Any
    transform_state: Any
    loaded: dict[str, Any] | None

    @classmethod
    def start(cls, epoch: int, transform_state: Any) -> Position:
        """Before epoch ``epoch``'s first batch, the source as it is."""
        return cls(epoch, 0, AS_BUILT, transform_state, None)

    def advance(self, epoch: int, handed_out: int, source_state: Any, transform_state: Any) -> None:
        """Batch ``handed_out`` of ``epoch`` was handed out (in place: this runs per batch).

        ``Lineage.handed_out`` writes the same out, without this call, for the steady path.

        ``transform_state`` None keeps the last one (a transform without state).
        """
        self.epoch = epoch
        self.handed_out = handed_out
        self.source_state = source_state
        self.loaded = None
        if transform_state is not None:
            self.transform_state = transform_state

    def after(self, epoch: int, handed_out: int, source_state: Any) -> Position:
        """A new position: ``handed_out`` batches of ``epoch`` received, the transform as now."""
        return Position(epoch, handed_out, source_state, self.transform_state, None)

    def moved_to(self, epoch: int, *, keep_source_state: bool, keep_loaded: bool) -> Position:
        """The position once the epoch was set to ``epoch`` (by the user or on the sampler).

        ``keep_source_state`` only when ``epoch`` is this position's own epoch, already begun.
        """
        loaded = self.loaded if keep_loaded else None
        if keep_source_state:
            return dataclasses.replace(self, loaded=loaded)
        handed_out = self.handed_out if loaded is not None else 0
        return Position(epoch, handed_out, AS_BUILT, self.transform_state, loaded)


def uncounts(at: Position, epochs: EpochSource) -> bool:
    """Whether a state saved at ``at`` can leave out batches handed out last.

    Where the epoch's order is drawn again on resume and the batches before are skipped: not
    where the source keeps its own state, nor a transform, which moved past them already.
    """
    return not epochs.stateful and at.transform_state is None


def state_of(at: Position, epochs: EpochSource, held: int = 0) -> dict[str, Any]:
    """The dictionary ``Prefetcher.state_dict()`` returns at position ``at``.

    ``held``: of the batches handed out, those the loop took ahead of its step and has not
    trained on (see :mod:`nostall._clients.lightning`); not counted where :func:`uncounts`, so that
    a resumed run hands them out again.
    """
    if at.loaded is not None:
        return at.loaded
    epoch, handed_out, saved = at.epoch, at.handed_out, at.source_state
    if held and isinstance(saved, dict) and uncounts(at, epochs):
        handed_out -= min(held, handed_out)  # its order is drawn again: they come again
    if saved is AS_BUILT:
        # Nothing handed out yet: the source is as it was built (or as set_epoch left it).
        saved = epochs.start_state()
    elif handed_out and handed_out == epochs.counted_length() and not epochs.stateful:
        # Every batch handed out, the end not yet asked for (Lightning never asks): resuming
        # from here starts the next epoch, not an empty rest of this one; how this epoch ended
        # is replayed if the resumed loop asks for the end. Only where len() counts the
        # batches: where it estimates them, the epoch may have more, and the state stays
        # where the user is (what was handed out, not what len() promised).
        end_of = {**saved, "batches": handed_out} if isinstance(saved, dict) else None
        after = epochs.end_state(epoch, saved)
        epoch, handed_out, saved = epoch + 1, 0, {**after, "end_of": end_of}
    elif handed_out and isinstance(saved, dict) and not epochs.stateful:
        # Inside the epoch: how the next epoch's order is drawn, which across epochs the
        # producer may have done already, before this state or the user's own checkpoint.
        saved = {**saved, **epochs.next_epoch(epoch)}
    state: dict[str, Any] = {
        "nostall": STATE_VERSION,
        "epoch": epoch,
        "batches_yielded": handed_out,
        "source_state": saved if epochs.stateful else None,
        "replay": None
        if epochs.stateful or saved is None
        else {**saved, **describe_order(epochs.source), **_readers(epochs)},
    }
    if at.transform_state is not None:
        state["transform"] = at.transform_state
    return state


def with_source_draws(state: dict[str, Any], draws: DrawWatch) -> None:
    """Add to ``state`` the source's generators as they were around its last batch's pull.

    For a source known to draw (``draws.drew``), inside an epoch: ``pull_draws``, the states
    as the last batch's pull began (``DrawWatch.states_before``), which a resumed run that
    pulls the batches before the state sets before the last of them, so that a batch the
    source took ahead in that pull draws what it drew. For one that was loaded ahead
    (``draws.was_apart``), also ``source_draws``, the states after that pull: the generators
    the user's checkpoint saves are ahead of the loop by the batches loaded ahead; a resumed
    run sets the source's ones back to these once the batches before the state are skipped
    (``EpochSource._replay``), so that the batches after it draw what they drew. Elsewhere (or
    not recorded) ``draws`` warns instead, where it was loaded ahead.
    """
    replay, batches = state.get("replay"), state.get("batches_yielded")
    if isinstance(replay, dict) and batches and "end_of" not in replay:
        before = draws.states_before(state["epoch"], batches)
        if before is not None:
            replay = state["replay"] = {**replay, "pull_draws": before}
        found = draws.states_after(state["epoch"], batches) if draws.was_apart else None
        if found is not None:
            state["replay"] = {**replay, "source_draws": found}
            return
    if draws.was_apart:
        draws.ahead_of_the_loop()


def with_worker_draws(state: dict[str, Any], epochs: EpochSource) -> None:
    """Add to ``state`` its round of the draws of the loader's workers, where recorded.

    Inside an epoch of a loader whose workers' draws are recorded (see
    :mod:`nostall._sources.worker_draws`), or at its start where the workers persist:
    ``worker_draws``, the start of the round of ``num_workers`` batches the state falls in
    and each worker's generators then.
    """
    replay, batches = state.get("replay"), state["batches_yielded"]
    if not isinstance(replay, dict) or not epochs.records_workers():
        return
    persistent = epochs.kind.persistent
    workers = epochs.source.num_workers  # type: ignore[attr-defined]
    record = epochs.worker_record
    end_of = replay.get("end_of")
    if end_of is not None:
        # After an epoch's last batch, its end not asked for: a resume loads the ended epoch's
        # last round again to ask for it; persistent workers then go on from there.
        ended = record.round_of(state["epoch"] - 1, end_of["batches"], workers)
        if persistent and ended is not None:
            state["replay"] = {**replay, "end_of": {**end_of, "worker_draws": ended}}
        return
    if not batches:
        if persistent and not replay["fresh_iterator"]:  # else new workers, as they started
            recorded = record.start_of(state["epoch"], epochs.source)  # type: ignore[arg-type]
            if recorded is not None:
                state["replay"] = {**replay, "worker_draws": recorded}
        return
    recorded = record.round_of(state["epoch"], batches, workers)
    if recorded is None and not persistent:
        if batches < workers:  # the epoch's first round: its new workers as they started
            recorded = {"batches": 0, "states": [None] * workers}
        else:
            warn_unrecorded_worker_draws(state["epoch"], batches)
    if recorded is not None:
        state["replay"] = {**replay, "worker_draws": recorded}


def warn_unrecorded_worker_draws(epoch: int, batches: int) -> None:
    """A state whose round of the workers' draws is no longer kept: said where it is saved.

    Only where the producer ran further ahead of the loop than the record keeps (more epochs
    than batches ahead, say): a resume from it gets the same samples with other draws.
    """
    warn(
        f"nostall: the random numbers this loader's worker processes drew before batch "
        f"{batches} of epoch {epoch} are no longer recorded (the loading ran too far ahead "
        f"of this state): a run resumed from it gets the same samples in the same order, with "
        f"other random values wherever the workers draw. Save the state closer to the loop "
        f"(a smaller depth=) for the values of an uninterrupted run",
        UserWarning,
    )


def loaded_position(
    state: object, epochs: EpochSource, transform: object, now: Position
) -> Position:
    """The position that resumes from ``state`` (checked first); ``now`` is the current one.

    Raises:
        ValueError: the state is not one nostall wrote, or does not fit this source or this
            transform.
    """
    checked = check_state(state, epochs)
    transform_state = checked.get("transform")
    if transform_state is not None and transform is not None:
        check = getattr(transform, "check_state", None)
        if callable(check):
            check(transform_state)  # a mismatch fails here, not at the next epoch
        elif not isinstance(transform, StatefulTransform):
            raise ValueError(
                f"the state holds a transform state, but this prefetcher's transform "
                f"{transform!r:.60} has no load_state_dict(); pass the transform it was saved "
                f"with"
            )
    else:
        transform_state = now.transform_state
    return Position(
        checked["epoch"], checked["batches_yielded"], AS_BUILT, transform_state, checked
    )


def check_state(state: object, epochs: EpochSource) -> dict[str, Any]:
    """Validate a loaded state against the source; return it, or raise ``ValueError``.

    Every field is checked here, at load time, so that a damaged or foreign state is refused
    with the field's name instead of failing later inside ``next()``. Each message names the
    field it checked, the value received, and what to pass.
    """
    if not isinstance(state, dict) or state.get("nostall") != STATE_VERSION:
        if isinstance(state, dict):
            keys = ", ".join(repr(k) for k in list(state)[:6]) or "none"
            got = (
                f"a dict whose 'nostall' is {state['nostall']!r}"
                if "nostall" in state
                else f"a dict without a 'nostall' key (its keys: {keys})"
            )
        else:
            got = kind(state)
        raise ValueError(
            f"not a nostall Prefetcher state (expected a dict from Prefetcher.state_dict() with "
            f"'nostall': {STATE_VERSION}; got {got})"
        )
    for key in ("epoch", "batches_yielded"):
        _check_count(state.get(key), f"state[{key!r}]")
    length = epochs.counted_length()  # an estimate is no bound: the epoch may have more
    if length is not None and state["batches_yielded"] > length:
        raise ValueError(
            f"state['batches_yielded'] is {state['batches_yielded']}, past the end of an epoch "
            f"of {length} batches; pass a state saved from an identically built loader"
        )
    if epochs.stateful:
        saved = state.get("source_state")
        if saved is None and state["batches_yielded"] > 0:
            raise ValueError(
                f"state['source_state'] is None: this state was saved from a source without "
                f"state_dict(), but the source here has one (a "
                f"{type(epochs.source).__qualname__}); build the same kind of loader as when "
                f"the state was saved"
            )
        if saved is not None:
            _check_stateful_dataloader(saved, epochs.source)
        return state
    replay = state.get("replay")
    if not isinstance(replay, dict):
        if state.get("source_state") is not None:
            raise ValueError(
                f"state['source_state'] holds a source's own state_dict(), but the source here "
                f"has none (a {type(epochs.source).__qualname__}); build the same kind of "
                f"loader as when the state was saved (e.g. a StatefulDataLoader)"
            )
        raise ValueError(
            f"state['replay'] must be a dict of what the epoch's order was drawn from "
            f"({received(replay)}); pass a state from Prefetcher.state_dict()"
        )
    here = describe_order(epochs.source)
    length = replay.get("length")
    if length is not None and (not isinstance(length, int) or isinstance(length, bool)):
        raise ValueError(
            f"state['replay']['length'] must be an int or None ({received(length)}); the "
            f"checkpoint is damaged or not from Prefetcher.state_dict()"
        )
    if length != here["length"]:
        raise ValueError(
            f"the state was saved for a source of {replay.get('length')} batches, this one has "
            f"{here['length']}; resume with an identically built loader (same dataset, batch "
            f"size, drop_last, sampler)"
        )
    if replay.get("samplers") != here["samplers"]:
        raise ValueError(
            f"the state was saved for samplers {replay.get('samplers')}, this source has "
            f"{here['samplers']}; resume with an identically built loader"
        )
    if state["batches_yielded"] > 0 or replay.get("end_of") is not None:
        _check_readers(replay, epochs)  # from an epoch's start nothing is skipped: any count
    _check_replay(replay, "state['replay']", state["batches_yielded"])
    return state


def _readers(epochs: EpochSource) -> dict[str, int]:
    """``stream_readers`` for a state's replay record, where the source is a stream."""
    readers = epochs.stream_readers()
    return {} if readers is None else {"stream_readers": readers}


def _check_readers(replay: dict[str, Any], epochs: EpochSource) -> None:
    """A stream's state resumes only with as many readers as it was saved with.

    Its batches take the readers' items in turn: with another count, skipping the batches
    handed out would skip other items, and the rest of the epoch would lose some and repeat
    others. (A state saved before the count was recorded is taken as it is.)
    """
    saved, here = replay.get("stream_readers"), epochs.stream_readers()
    if saved is None or here is None or saved == here:
        return
    if not isinstance(saved, int) or isinstance(saved, bool) or saved < 1:
        raise ValueError(
            f"state['replay']['stream_readers'] must be a positive int ({received(saved)}); "
            f"pass a state from Prefetcher.state_dict()"
        )
    same = (
        "leave threads= out, over a DataLoader with num_workers=0"
        if saved == 1
        else f"nostall.prefetch(loader, threads={saved}), or a DataLoader with "
        f"num_workers={saved} and no threads="
    )
    raise ValueError(
        f"this state was saved while {_readers_text(saved)} read the stream, and "
        f"{_readers_text(here)} read it here: its batches take the readers' items in turn, so "
        f"the rest of the epoch would lose some items and repeat others. Resume with the same "
        f"count: {same}"
    )


def _readers_text(n: int) -> str:
    return "one reader" if n == 1 else f"{n} loading threads or workers"


#: The largest count or epoch a state may hold: an int64, as torch keeps them (a
#: ``DistributedSampler`` seeds its shuffle with ``seed + epoch``; past it, that fails).
MAX_COUNT = 2**63 - 1


def _check_count(value: object, field: str) -> None:
    """An int from 0 to :data:`MAX_COUNT` (``bool`` refused), else ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ValueError(
            f"{field} must be an int >= 0 and < 2**63 ({received(value)}); pass a state from "
            f"Prefetcher.state_dict()"
        )


def _check_stateful_dataloader(saved: object, source: object) -> None:
    """A torchdata ``StatefulDataLoader``'s state is one its next ``iter()`` takes.

    torchdata reads a loaded state only when the next iterator is created, and refuses one
    saved with another ``num_workers`` (or not its own) there with an ``AssertionError``;
    these are its checks, made at ``load_state_dict``. An empty dict is its fresh start.
    """
    module = sys.modules.get("torchdata.stateful_dataloader")
    loader_type = getattr(module, "StatefulDataLoader", None)
    if loader_type is None or not isinstance(source, loader_type) or saved == {}:
        return
    fix = "pass the state_dict() of an identically built StatefulDataLoader"
    if not isinstance(saved, dict):
        raise ValueError(
            f"state['source_state'] must be a StatefulDataLoader's state_dict(), a dict "
            f"({received(saved)}); {fix}"
        )
    snapshot = saved.get("_snapshot")
    if "_num_yielded" in saved:  # the single-process iterator's state
        workers: object = 0
    elif isinstance(snapshot, dict) and isinstance(snapshot.get("_main_snapshot"), dict):
        workers = snapshot["_main_snapshot"].get("_num_workers")
    else:
        raise ValueError(
            f"state['source_state'] is no StatefulDataLoader state (it has neither "
            f"'_num_yielded' nor a '_snapshot' with a '_main_snapshot'; keys "
            f"{sorted(map(str, saved))[:8]}); {fix}"
        )
    here = getattr(source, "num_workers", None)
    if workers != here:
        raise ValueError(
            f"state['source_state'] was saved from a StatefulDataLoader with num_workers="
            f"{workers!r}, and this one has num_workers={here}; build it with num_workers="
            f"{workers!r}, as when the state was saved"
        )


def _check_replay(replay: dict[str, Any], where: str, yielded: int) -> None:
    """The replay record at ``where`` (``state['replay']``, or its ``['end_of']``).

    ``yielded``: the batches of its epoch handed out (``batches_yielded``, or the ended
    epoch's ``batches``).
    """
    end_of = replay.get("end_of")
    if end_of is not None:
        if not isinstance(end_of, dict):
            raise ValueError(
                f"{where}['end_of'] must be None or a dict with 'batches' ({received(end_of)}); "
                f"pass a state from Prefetcher.state_dict()"
            )
        _check_count(end_of.get("batches"), f"{where}['end_of']['batches']")
        _check_replay(
            {k: v for k, v in end_of.items() if k != "batches"},
            f"{where}['end_of']",
            end_of["batches"],
        )
    next_rng = replay.get("next_rng")
    if next_rng is not None:
        try:
            torch.Generator().set_state(next_rng)  # the same check a real restore would make
        except (TypeError, RuntimeError) as e:
            raise ValueError(
                f"{where}['next_rng'] is not a CPU generator state ({e}); the "
                f"checkpoint is damaged or not from Prefetcher.state_dict()"
            ) from e
    sampler_epoch = replay.get("sampler_epoch")
    if sampler_epoch is not None:
        _check_count(sampler_epoch, f"{where}['sampler_epoch']")
    if not isinstance(replay.get("fresh_iterator"), bool):
        raise ValueError(
            f"{where}['fresh_iterator'] must be True or False ("
            f"{received(replay.get('fresh_iterator'))}); pass a state from "
            f"Prefetcher.state_dict()"
        )
    check_count(replay, where)
    rng = replay.get("rng")
    if not isinstance(rng, dict) or "torch" not in rng:
        raise ValueError(
            f"{where}['rng'] must be a dict of generator states with a 'torch' entry ("
            f"{received(rng)}); pass a state from Prefetcher.state_dict()"
        )
    _check_source_draws(replay.get("source_draws"), f"{where}['source_draws']")
    _check_source_draws(replay.get("pull_draws"), f"{where}['pull_draws']")
    _check_worker_draws(replay.get("worker_draws"), f"{where}['worker_draws']", yielded)
    for name, value in rng.items():
        try:
            torch.Generator().set_state(value)  # the same check a real restore would make
        except (TypeError, RuntimeError) as e:
            raise ValueError(
                f"{where}['rng'][{name!r}] is not a CPU generator state ({e}); the "
                f"checkpoint is damaged or not from Prefetcher.state_dict()"
            ) from e


def _check_worker_draws(saved: object, where: str, yielded: int) -> None:
    """Refuse a record of the workers' draws that a resume could not set.

    Its ``batches`` start the round of ``len(states)`` batches that ``yielded`` falls in.
    """
    if saved is None:
        return
    fix = "the checkpoint is damaged or not from Prefetcher.state_dict()"
    states = saved.get("states") if isinstance(saved, dict) else None
    if not isinstance(saved, dict) or not isinstance(states, list | tuple) or not states:
        raise ValueError(
            f"{where} must be a dict with 'batches' and a list of 'states', one per worker "
            f"({received(saved)}); {fix}"
        )
    start = saved.get("batches")
    _check_count(start, f"{where}['batches']")
    if start != yielded - yielded % len(states):
        raise ValueError(
            f"{where}['batches'] is {start}, not the start of the round of {len(states)} "
            f"batches that the {yielded} batches handed out end in "
            f"({yielded - yielded % len(states)}); {fix}"
        )
    for worker, worker_states in enumerate(states):
        if worker_states is not None and not (
            isinstance(worker_states, dict) and {"torch", "random"} <= set(worker_states)
        ):
            raise ValueError(
                f"{where}['states'][{worker}] must be None or a dict with the 'torch' and "
                f"'random' generators' states ({received(worker_states)}); {fix}"
            )
        _check_source_draws(worker_states, f"{where}['states'][{worker}]")


def _check_source_draws(saved: object, where: str) -> None:
    """Refuse generator states a resume could not set (``source_draws``, ``pull_draws``)."""
    if saved is None:
        return
    fix = "the checkpoint is damaged or not from Prefetcher.state_dict()"
    if not isinstance(saved, dict) or not set(saved) <= {"torch", "random", "numpy"}:
        raise ValueError(
            f"{where} must be a dict of the 'torch', 'random' and 'numpy' generators' states "
            f"({received(saved)}); {fix}"
        )
    try:
        if "torch" in saved:
            torch.Generator().set_state(saved["torch"])
        if "random" in saved:
            random.Random().setstate(as_tuples(saved["random"]))
        if "numpy" in saved:
            kind, keys, position, has_gauss, gauss = saved["numpy"]
            if kind != "MT19937" or not isinstance(keys, torch.Tensor) or keys.numel() != 624:
                raise ValueError(f"not a NumPy MT19937 state: {kind!r}")
            _check_count(position, f"{where}['numpy'] position")
            if position > 624 or has_gauss not in (0, 1) or not isinstance(gauss, float):
                raise ValueError(
                    f"not a NumPy MT19937 state: position {position!r} (at most 624), "
                    f"has_gauss {has_gauss!r} (0 or 1), gauss {gauss!r} (a float)"
                )
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{where} holds a state that cannot be set back ({e}); {fix}") from e
