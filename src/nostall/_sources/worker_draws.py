"""Random numbers drawn in a DataLoader's worker processes: recorded per batch, resumed.

A dataset that augments (a random crop, a flip) draws from its worker process's global
generators (torch's, Python's ``random``, NumPy's), which torch seeds per worker at each epoch
from the loader's base seed. Worker ``w`` loads batches ``w``, ``w + N``, ``w + 2N``, ... of
the epoch (torch hands a map-style epoch's batches out in turn, ``in_order``), so the numbers
batch ``k`` gets depend on every batch its worker loaded before it. A resume that skips the
batches already trained through the sampler (loading nothing) starts fresh workers: the same
samples, other numbers.

So nostall records them. Over a loader whose workers start anew each epoch, it iterates a
copy whose ``collate_fn`` is :class:`Stamp`: each batch comes from its worker as a
:class:`Stamped` value that carries the worker's generators after it (only when they moved
since that worker's last batch), taken off again before anything else sees the batch
(:class:`Unstamped`). :class:`WorkerRecord` keeps, every ``N`` batches, each worker's latest
states: what a state saved after batch ``k`` needs is the round that starts at
``k - k % N``. A resumed run skips that many batches through the sampler, starts its workers
at the recorded states (:class:`Restore`, after the loader's own ``worker_init_fn``) and loads
and drops the ``k % N`` batches left, so that every batch is loaded by the worker, and from the
states, of the uninterrupted run.

A loader with persistent workers keeps one iterator, and its workers, from epoch to epoch; the
iterator takes its ``collate_fn`` when it is created. nostall creates it, where the loader has
none, with :class:`Stamp` in place of the loader's own for that call only, and its workers
stamp only while nostall iterates (a switch in shared memory, :class:`Switch`, turned off at
the end of nostall's epoch, when its prefetcher closes, and when anyone else starts an epoch of
the iterator): a loop over the loader itself gets the loader's own batches. An epoch of such
workers that did not run to its end through nostall (a ``break``, the loader iterated
directly) leaves draws behind that nostall did not see: the next epoch's first round is not
recorded (a state saved there resumes with a warning).

Invariant: a :class:`Stamped` value never leaves :class:`Unstamped`; the user, the staging and
the state see the loader's own batches.
"""

from __future__ import annotations

import array
import collections
import copy
import pickle
import random
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, get_worker_info

from .._torch_compat import (
    attributes_swapped,
    copy_loader,
    forget_iterator,
    live_iterator,
    on_reset,
)
from .generators import Saved, as_tuples, moved, set_states, snapshot


class Stamped(NamedTuple):
    """A batch as its worker returns it: which worker, and its generators after it (or None).

    ``states``: the pickled :func:`_raw_states`, only where they differ from the ones this
    worker sent last (a worker's first batch sends them). A named tuple, so that the loader's
    ``pin_memory`` pins the batch inside it.
    """

    batch: Any
    worker: int
    states: bytes | None


class Switch:
    """Whether a persistent iterator's workers stamp, in memory the workers share.

    ``on`` while nostall iterates an epoch of it; off otherwise, when each batch collated is
    counted (``foreign``): nostall tells from that count that someone else iterated it.
    """

    def __init__(self) -> None:
        self.values = torch.zeros(2, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]

    @property
    def on(self) -> bool:
        return bool(self.values[0])

    @on.setter
    def on(self, value: bool) -> None:
        self.values[0] = int(value)

    @property
    def foreign(self) -> int:
        """Batches collated while off (a count that only grows; racing workers may lose one)."""
        return int(self.values[1])

    def count_foreign(self) -> None:
        self.values[1] += 1


class Stamp:
    """The loader's ``collate_fn``, run in a worker: the batch, stamped with its states.

    One copy lives in each worker process (pickled or forked into it); ``_sent`` is that
    worker's last sent states. Reading them costs about 0.1 ms a batch (NumPy's is most of
    it), in the worker, beside the batch's own loading. ``switch``: for a persistent iterator,
    stamps only while it is on (else the loader's batch, counted); None: always.
    """

    def __init__(self, collate: Callable[[Any], Any], switch: Switch | None = None) -> None:
        self.collate, self.switch = collate, switch
        self._sent: RawStates | None = None

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        info = get_worker_info()
        if info is None:  # collated in the main process: no worker to record
            return batch
        if self.switch is not None and not self.switch.on:
            self.switch.count_foreign()
            return batch
        states = _raw_states()
        if states == self._sent:
            return Stamped(batch, info.id, None)
        self._sent = states
        return Stamped(batch, info.id, pickle.dumps(states, protocol=pickle.HIGHEST_PROTOCOL))

    def __repr__(self) -> str:
        return f"nostall.Stamp({self.collate!r})"


#: A worker's generators as read in it, cheaply: torch's state's bytes, Python's ``random``
#: state, NumPy's legacy state as (keys' bytes, position, has_gauss, gauss), or None.
RawStates = tuple[bytes, Any, tuple[bytes, int, int, float] | None]


def _raw_states() -> RawStates:
    """This process's global generators' whole states (NumPy's once it is imported)."""
    numpy: Any = sys.modules.get("numpy")
    legacy = None
    if numpy is not None:
        _, keys, position, has_gauss, gauss = numpy.random.get_state()
        legacy = (keys.tobytes(), int(position), int(has_gauss), float(gauss))
    return (bytes(torch.default_generator.get_state().numpy()), random.getstate(), legacy)


def _saved(raw: RawStates) -> dict[str, Any]:
    """Raw states as a checkpoint keeps them (:func:`~nostall._sources.generators.states_of`)."""
    torch_state, python, legacy = raw
    saved: dict[str, Any] = {
        "torch": torch.frombuffer(bytearray(torch_state), dtype=torch.uint8),
        "random": python,
    }
    if legacy is not None:
        keys, position, has_gauss, gauss = legacy
        words = torch.tensor(array.array("I", keys).tolist(), dtype=torch.int64)
        saved["numpy"] = ("MT19937", words, position, has_gauss, gauss)
    return saved


def _raw(saved: dict[str, Any]) -> RawStates:
    """The inverse of :func:`_saved`, for a resumed run's record."""
    legacy = None
    if "numpy" in saved:
        _, words, position, has_gauss, gauss = saved["numpy"]
        keys = array.array("I", [int(w) & 0xFFFFFFFF for w in words.tolist()]).tobytes()
        legacy = (keys, int(position), int(has_gauss), float(gauss))
    torch_state = bytes(saved["torch"].to(torch.uint8).tolist())
    return (torch_state, as_tuples(saved["random"]), legacy)


class Restore:
    """A resumed copy's ``worker_init_fn``: the loader's own, then the recorded states.

    ``states[w]`` is what worker ``w`` had after its last batch before the resumed round (a
    checkpoint-safe :func:`states_of` dictionary), or None where it had loaded none: a fresh
    worker, seeded as the uninterrupted one was, starts as it did.
    """

    def __init__(
        self, init: Callable[[int], None] | None, states: list[dict[str, Any] | None]
    ) -> None:
        self.init, self.states = init, states

    def __call__(self, worker_id: int) -> None:
        if self.init is not None:
            self.init(worker_id)
        states = self.states[worker_id]
        if states is not None:
            set_states(states)


class WorkerRecord:
    """The states of one source's workers, every ``N`` batches of each epoch pulled.

    Used in the thread that pulls (the producer's, or the consumer's when a resume opens an
    epoch); read when a state is saved, in the consumer's. Entries are only added and evicted
    oldest first, each a tuple made once: a read sees a whole entry or none. ``ahead``: the
    most batches the producer pulls ahead of the consumer; rounds further behind are dropped.
    """

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        #: (epoch, batches pulled, a multiple of N; or -1: the epoch before it ended) -> each
        #: worker's pickled states then.
        self._rounds: collections.OrderedDict[tuple[int, int], tuple[bytes | None, ...]] = (
            collections.OrderedDict()
        )
        #: A persistent loader's iterator whose workers stamp (created here), its switch,
        #: its workers' latest states (carried from epoch to epoch, as the workers are),
        #: whether its last epoch through nostall ran to its end, and the switch's count of
        #: batches collated for someone else then.
        self._stamping: weakref.ref[object] | None = None
        self._switch: Switch | None = None
        self._latest: list[bytes | None] = []
        self._ended = True
        self._foreign = 0
        #: nostall is starting an epoch of that iterator now (see :meth:`_reset_elsewhere`).
        self._opening = False

    def look_ahead(self, batches: int) -> None:
        """From now on the producer pulls up to ``batches`` ahead of the loop (a new depth)."""
        self.ahead = batches

    def iterate_persistent(
        self,
        loader: DataLoader[Any],
        open_epoch: Callable[[DataLoader[Any]], Iterator[Any]],
        epoch: int,
        resume: PersistentResume | None = None,
    ) -> Iterator[Any]:
        """An epoch of a loader that keeps its workers, through workers that stamp.

        Where the loader has no live iterator, the ``iter()`` that creates one (its worker
        processes) is made with :class:`Stamp` as its ``collate_fn`` (and, for ``resume``,
        with the resumed workers' ``worker_init_fn``, index sampler and base-seed generator),
        the loader's own attributes set back at once. A live iterator that was created
        elsewhere (its workers do not stamp for this record) is iterated as it is, its epochs
        not recorded.
        """
        workers = loader.num_workers
        if live_iterator(loader) is None:
            created = Switch()
            swaps: dict[str, Any] = {"collate_fn": Stamp(loader.collate_fn, created)}
            skipped, latest = 0, _fresh(workers)
            if resume is not None:
                swaps.update(resume.swaps)
                skipped, latest = resume.start, list(resume.restored)
            created.on = True
            with attributes_swapped(loader, **swaps):
                it = open_epoch(loader)
            live = live_iterator(loader)
            assert live is not None  # created by this iter()
            on_reset(live, self._reset_elsewhere)
            self._stamping, self._switch, self._latest = weakref.ref(live), created, latest
            self._ended, self._foreign = False, 0
            return Unstamped(it, self, epoch, skipped, latest, ends=created)
        switch = self._switch
        if switch is None or not self._owns(loader):
            return Unstamped(open_epoch(loader), self, epoch, 0, _fresh(workers), keep=False)
        # Draws this record did not see (an epoch left before its end, batches collated for
        # someone else) make this epoch's first round unknown: not recorded.
        seen_all = self._ended and switch.foreign == self._foreign
        switch.on = True
        self._ended, self._opening = False, True
        try:
            it = open_epoch(loader)
        finally:
            self._opening = False
        return Unstamped(it, self, epoch, 0, self._latest, ends=switch, first_round=seen_all)

    def _owns(self, loader: DataLoader[Any]) -> bool:
        """Whether the loader's live iterator is the one this record's workers stamp for."""
        live = live_iterator(loader)
        return live is not None and self._stamping is not None and self._stamping() is live

    def _reset_elsewhere(self) -> None:
        """The stamping iterator starts an epoch: unless nostall's, its workers stop stamping.

        Someone else iterates the loader (a loop over it after an epoch nostall left early):
        its batches are its own, and what its workers draw for them is not seen.
        """
        if not self._opening and self._switch is not None:
            self._switch.on = False
            self._ended = False

    def ended(self, switch: Switch) -> None:
        """An epoch of the persistent iterator ran to its end through nostall: switch it off."""
        switch.on = False
        self._ended, self._foreign = True, switch.foreign

    def release(self) -> None:
        """nostall is done with the loader: its workers stop stamping (a loop over it is plain)."""
        if self._switch is not None:
            self._switch.on = False

    def forget_workers(self, loader: DataLoader[Any]) -> bool:
        """Let go of the loader's workers where they are this record's; whether they were.

        A resume inside this process starts new ones, at the state's recorded states (the
        running ones drew past them).
        """
        if not self._owns(loader):
            return False
        self.release()
        forget_iterator(loader)
        self._stamping = self._switch = None
        return True

    def iterate(
        self,
        loader: DataLoader[Any],
        open_epoch: Callable[[DataLoader[Any]], Iterator[Any]],
        epoch: int,
        skipped: int = 0,
        restored: tuple[bytes | None, ...] | None = None,
    ) -> Iterator[Any]:
        """An epoch's iterator over a stamping copy of ``loader``, its batches unstamped.

        ``skipped``: the batches the loader's sampler skips (a multiple of its workers);
        ``restored``: the states its workers start at (a resume), else fresh ones.
        """
        workers = loader.num_workers
        copy = copy_loader(loader, collate_fn=Stamp(loader.collate_fn))
        latest = _fresh(workers) if restored is None else list(restored)
        return Unstamped(open_epoch(copy), self, epoch, skipped, latest)

    def _keep(self, key: tuple[int, int], latest: list[bytes | None]) -> None:
        self._rounds[key] = tuple(latest)
        kept = max(0, self.ahead // max(1, len(latest)) + 5)  # rounds a state can ask for
        while len(self._rounds) > kept:
            self._rounds.popitem(last=False)

    def round_of(self, epoch: int, batches: int, workers: int) -> dict[str, Any] | None:
        """What a state saved after ``batches`` of ``epoch`` records of the workers' draws.

        ``{"batches": b, "states": [...]}``: the round's start ``b`` (``batches`` less
        ``batches % workers``) and each worker's states then (checkpoint-safe dictionaries,
        None for a worker that had loaded nothing). None where that round is not recorded
        (not iterated here, not seen whole, or dropped).
        """
        start = batches - batches % workers
        return self._as_saved(start, self._rounds.get((epoch, start)), workers)

    def start_of(self, epoch: int, loader: DataLoader[Any]) -> dict[str, Any] | None:
        """:meth:`round_of` for a state at ``epoch``'s start, over persistent workers.

        The round nostall recorded as it opened the epoch, else the one where the epoch before
        it ended, provided the loader's workers are still this record's and did nothing since
        (no epoch left early, no batch collated for someone else).
        """
        kept = self._rounds.get((epoch, 0))
        switch = self._switch
        if (
            kept is None
            and switch is not None
            and self._owns(loader)
            and self._ended
            and switch.foreign == self._foreign
        ):
            kept = self._rounds.get((epoch, -1))
        return self._as_saved(0, kept, loader.num_workers)

    @staticmethod
    def _as_saved(
        start: int, kept: tuple[bytes | None, ...] | None, workers: int
    ) -> dict[str, Any] | None:
        """A kept round as a state records it (None where not kept, or for other workers)."""
        if kept is None or len(kept) != workers:
            return None
        return {
            "batches": start,
            "states": [None if s is None else _saved(pickle.loads(s)) for s in kept],
        }


class PersistentResume(NamedTuple):
    """How a resumed run creates a persistent loader's workers where a state recorded them.

    ``swaps``: the loader attributes its iterator is created with (beside the stamping
    ``collate_fn``): a :class:`Restore` ``worker_init_fn``, an index sampler that skips
    ``start`` batches in its first epoch only, and, where the uninterrupted run's workers
    started in an earlier epoch, a throwaway ``generator`` for their base seed (the order is
    drawn from the recorded generators, as that epoch drew it, and every worker that loaded
    anything is set to its recorded states). ``restored``: those states, as the record keeps
    them.
    """

    start: int
    restored: tuple[bytes | None, ...]
    swaps: dict[str, Any]


def _fresh(workers: int) -> list[bytes | None]:
    """Fresh workers' latest states: none recorded (each starts from its seed)."""
    return [None] * workers


class Unstamped:
    """An epoch's iterator over stamped batches: each batch unstamped, its states recorded.

    Counts the batches pulled (one that raised too: the uninterrupted epoch handed it out as
    its error) from ``skipped``; at every multiple of the workers' count, the record keeps
    each worker's latest states (``latest``, updated from each batch's stamp), the epoch's
    first one only where ``first_round``. ``keep=False``: workers this record does not own,
    whose batches may come stamped (another prefetcher's switch left on): only unstamped.
    ``ends``: a persistent iterator's switch, turned off at the epoch's end.
    """

    __slots__ = ("_ends", "_epoch", "_it", "_latest", "_pulled", "_record", "_workers")

    def __init__(
        self,
        it: Iterator[Any],
        record: WorkerRecord,
        epoch: int,
        skipped: int,
        latest: list[bytes | None],
        *,
        keep: bool = True,
        ends: Switch | None = None,
        first_round: bool = True,
    ) -> None:
        self._it, self._record, self._epoch, self._ends = it, record, epoch, ends
        self._pulled, self._latest = skipped, latest
        # A worker count of 0 keeps no round.
        self._workers = len(latest) if keep else 0
        if keep and first_round:
            record._keep((epoch, skipped), latest)

    def __iter__(self) -> Unstamped:
        return self

    def __next__(self) -> Any:
        try:
            stamped = next(self._it)
        except StopIteration:
            if self._ends is not None:
                self._record.ended(self._ends)
            if self._workers and self._ends is not None:  # the next epoch starts from here
                self._record._keep((self._epoch + 1, -1), self._latest)
            raise
        except Exception:
            self._counted()
            raise
        if type(stamped) is not Stamped:  # workers that do not stamp for this record
            self._counted()
            return stamped
        if stamped.states is not None and self._workers:
            self._latest[stamped.worker] = stamped.states
        self._counted()
        return stamped.batch

    def _counted(self) -> None:
        self._pulled += 1
        if self._workers and self._pulled % self._workers == 0:
            self._record._keep((self._epoch, self._pulled), self._latest)


def restored_states(saved: list[Any]) -> tuple[bytes | None, ...]:
    """A state's recorded worker states, pickled again as a resumed run's record keeps them."""
    return tuple(
        None if s is None else pickle.dumps(_raw(s), protocol=pickle.HIGHEST_PROTOCOL)
        for s in saved
    )


def draws_in_workers(loader: DataLoader[Any]) -> bool | None:
    """Whether the loader's workers draw from their global generators as they load, as seen.

    Tried once, in this process: the first sample of a shallow copy of its dataset (collated
    as a batch of one, where the loader collates batches), the generators put back afterwards.
    None where the trial raised (a dataset that only loads in a worker, say): it cannot tell.
    """
    try:
        # A shallow copy: a handle the dataset opens on first use (h5py, lmdb) is opened on
        # the copy, not on the dataset the workers are made from.
        dataset: Any = copy.copy(loader.dataset)
        if len(dataset) == 0:
            return False
        saved = Saved()
        try:
            sample = dataset[0]
            if loader.batch_sampler is not None:
                loader.collate_fn([sample])
            return bool(moved(saved.before, snapshot()))
        finally:
            saved.put_back()
    except Exception:
        return None
