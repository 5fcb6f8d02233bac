"""Draws from the process's global random generators, and how a prefetcher keeps their order.

Why it matters: a global generator (torch's CPU generator, torch.cuda's, Python's ``random``,
NumPy's ``np.random``) is one stream shared by every thread, so the value a draw gets depends
on the order of all draws. In a plain loop over a ``DataLoader`` with ``num_workers=0``, batch
k is loaded in the loop's thread right before step k: the source's draws for batch k (a
collator masking tokens, as ``DataCollatorForLanguageModeling(seed=None)`` does; a random crop
in ``__getitem__``, as torchvision's v2 transforms do) come right before step k's own (dropout).
A prefetcher that loads batch k+1 while step k runs interleaves the two streams in whatever
order the threads run: other values than the plain loop, and other values on every run.

What a prefetcher does about it (one :class:`DrawWatch` per prefetcher, decided once):

* Under ``threads=``, a sample's draws through the global entry points (``torch.rand``,
  ``random.random``, ``np.random.rand``, ...) go to a generator of the sample's own
  (:mod:`nostall._loading.own_draws`), as do a batch's collate's: they move no global
  generator, and what this watch sees is what escapes that routing.
* While it is not known whether the source draws, it is pulled **in step** with the loop: a
  batch is pulled only when the loop asks for it (by the loop's thread, or by the producer
  while the loop waits), so every draw happens where the plain loop makes it. Under
  ``threads=N`` (N > 1) that batch is fetched on trial
  (:class:`~nostall._sources.generators.Trial`): its first sample alone, in the pulling
  thread, the generators' positions compared around it. Nothing moved: the N threads fetch
  the rest (and, after a sampler known to draw only when it starts, the next batches' while
  fewer than N samples are in flight). Something moved: the rest are fetched after it one at
  a time, in order, in the pulling thread, and the source is in step for good. Nothing is
  ever put back, so a draw made meanwhile by another thread is never drawn twice. Known to
  draw, its samples are loaded one at a time from then on. Seen only by the pull's own
  judgement after the threads fetched the rest (a later sample escaped): in step for good
  too, and the warning says that the batches loaded before drew in the threads' order.
  Where the draws were its samples' (not a ``transform=``'s, nor a batch sampler's before the
  trial), the DataLoader is remembered (:data:`_ESCAPING`): a later prefetcher over it (one
  made each epoch) loads its samples one at a time from its first batch.
* A pull is judged: the global generators' states are compared before and after it
  (:mod:`nostall._sources.generators`). An epoch's first pull is judged only where the source is
  known to draw nothing when it starts (a ``DataLoader`` whose sampler is sequential or has a
  generator of its own): a ``RandomSampler`` without a generator draws its order there, as an
  iterable may, once per epoch, at the same point as in the plain loop. Nothing moved: the
  watch is clear for good and prefetching starts (the cost, where the first pull cannot be
  judged: the second batch is not fetched ahead).
* Something moved, without threads: each generator is watched on its own. The loop is looked
  at between two batches too (from the moment it takes a batch to the moment it asks for the
  next, with no pull in between: what moved then is the loop's own, its step's dropout or a
  random scale). Once the loop was seen at least once: it drew from none of the source's
  generators (the usual GPU case: the source's augmentations draw from torch's CPU generator
  or ``random``, the step's dropout from torch.cuda's), so the source is prefetched
  (``APART``): each generator it draws from is drawn by nobody else, and so in the plain
  loop's order. It drew from one of them: the source stays in step for the prefetcher's life
  (exact, but nothing is fetched ahead) and :class:`GlobalDrawsWarning` names the generator,
  the cost and the fix, once, at the user's line.
* While ``APART``, a loop that starts drawing from the source's generators later (its step
  draws from epoch 3 on; another ``DataLoader``'s ``iter()`` between two epochs fetched ahead)
  is caught two ways: each pull must find those generators where the last pull left them (a
  draw between two pulls is someone else's); and every :data:`RECHECK_PULLS` pulls the watch
  goes back in step (``RECHECK``) until it saw the loop alone between two batches again,
  for the loop whose draws always fall while a pull runs. Caught: in step for good, and the
  warning says that the batches loaded ahead before that drew in another order than the
  plain loop. With ``threads=``, something that moved escaped the samples' own generators
  (see above): in step for good, its samples loaded one at a time.
* A ``DataLoader`` with worker processes is clear from the start: its dataset and
  ``collate_fn`` run in the workers, each seeded by the DataLoader; the loop's process draws
  only the workers' base seed, when the epoch's iterator is created (by nostall in the loop's
  thread at the epoch's first ``next()``, where the plain loop's ``for`` creates it). So is a
  ``list`` or ``tuple`` of batches (no code runs to make them) without a ``transform=``.

What it cannot see: a source that draws only at later batches or samples, or only sometimes;
a loop that draws from the source's generators only now and then, and never between two pulls
nor at a recheck (a one-off draw made while a pull runs, as another loader's ``iter()`` in the
middle of an epoch, where loading is the bottleneck and a pull nearly always runs); and a draw
made meanwhile by another thread of the process reads as the source's (a false alarm: it costs
speed, and the warning says that it may be another thread's).
A state saved once ``APART`` (``state_dict()``) meets generators the producer left ahead of
the loop: inside an epoch it holds the source's as after its last batch
(:meth:`DrawWatch.states_after`, set back by a resumed run); elsewhere it warns
(:meth:`DrawWatch.ahead_of_the_loop`).
"""

from __future__ import annotations

import collections
import contextlib
import enum
import random
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    default_collate,
    default_convert,
)

from .._clients.timm import TIMM_FIX, is_timm_prefetch_loader
from .._torch_compat import index_sampler
from .._warn import warn
from .generators import (
    TORCH,
    Snapshot,
    Trial,
    escape_since,
    escapes_noted,
    moved,
    snapshot,
    states_of,
)
from .sources import SourceKind

M = TypeVar("M")

#: Pulls judged (not an epoch's first) that must show no draw before prefetching starts. One:
#: the sources that draw (collators, random augmentations) draw at every batch, and each
#: judged pull is a batch not fetched ahead.
JUDGED_PULLS = 1


#: The states of a prefetched source's generators kept, one per batch pulled ahead: a state
#: saved within this many batches of the producer's finds the one after its last batch.
KEPT_STATES = 256

#: Pulls of a source that draws, prefetched (APART), between two looks at the loop alone
#: between two batches (RECHECK: the prefetched batches are handed out, then one is pulled in
#: step). A loop that starts drawing from the source's generators while a pull runs every
#: time is seen within this many batches; each look costs about one batch's load.
RECHECK_PULLS = 100


class GlobalDrawsWarning(UserWarning):
    """A source draws from the global generators, so nostall loads it in step with the loop."""


#: In this thread: ``.unreported`` (watch, but say nothing) or ``.unwatched`` (do not watch):
#: set by nostall's own code that iterates a user's loader to measure or check it (``tune``,
#: the doctor, the thread-safety check), which says what it saw in its own words.
_context = threading.local()


@contextmanager
def _set(name: str) -> Iterator[None]:
    before = getattr(_context, name, False)
    setattr(_context, name, True)
    try:
        yield
    finally:
        setattr(_context, name, before)


def unreported() -> Any:
    """Meanwhile, in this thread, a :class:`DrawWatch` warns of nothing (``tune``'s trials)."""
    return _set("unreported")


def unwatched() -> Any:
    """Meanwhile, in this thread, prefetchers are built without a watch.

    For callers that judge the draws themselves (the thread-safety check compares the
    generators around each of its loads).
    """
    return _set("unwatched")


def draws_of(loader: Iterable[Any]) -> tuple[str, ...]:
    """The global generators that loading ``loader``'s second batch drew from, in this thread.

    The first batch is not judged (a sampler may draw its order there); a loader of fewer than
    two batches shows nothing. The generators are put back as they were.
    """
    numpy: Any = sys.modules.get("numpy")
    states = (torch.get_rng_state(), random.getstate(), numpy and numpy.random.get_state())
    try:
        batches = iter(loader)
        if next(batches, _END) is _END:
            return ()
        before = snapshot()
        if next(batches, _END) is _END:
            return ()
        return moved(before, snapshot())
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(states[2])


_END = object()


class Watch(enum.Enum):
    """Where a :class:`DrawWatch` is."""

    #: Not known yet: pulls are made in step with the loop, and judged.
    WATCHING = "watching"
    #: A judged pull drew nothing: prefetching as usual, nothing judged any more.
    CLEAR = "clear"
    #: A judged pull drew: pulls stay in step with the loop for good.
    DRAWS = "draws"
    #: The source draws, the loop between two batches from none of the same generators:
    #: prefetching, each pull checked to start where the last one left those generators.
    APART = "apart"
    #: APART, back in step with the loop until it saw the loop alone between two batches again.
    RECHECK = "recheck"


class DrawWatch:
    """Whether one prefetcher's source draws from the global generators (see the module).

    Invariants:
        * ``in_step`` is True while WATCHING, RECHECK and DRAWS; while it is True the puller
          pulls only what the loop has asked for (its gate), so no draw of the source moves
          relative to the loop's own. CLEAR is for good; APART only while the loop is seen
          drawing from none of the generators the source draws from (``drew``).
        * ``watched``: every pull goes through :meth:`pull` (any state but CLEAR).
        * ``drew`` names what a judged pull drew from; it is reported once, by :meth:`report`,
          in the loop's thread.
    """

    def __init__(
        self,
        kind: SourceKind,
        *,
        threads: int | None = None,
        transform: bool = False,
        timeout: float | None = None,
    ):
        self.kind = kind
        self.threads = threads
        # With a timeout, the loop may return from next() (PrefetchTimeoutError) and draw while
        # a trial runs, and a trial that finds draws would put those back too: no trials.
        self.trials = timeout is None
        self.transform = transform
        # Nothing to watch where no code of the user's runs per batch in this process: worker
        # processes draw from their own seeds; a list's items are made already.
        workers = kind.workers > 0
        inert = kind.batches_known and not transform
        unwatched = getattr(_context, "unwatched", False)
        #: The source's sampler draws a new order from torch's generator in the middle of an
        #: epoch, at whichever pull reaches it (:func:`reshuffler`), workers or not: known to
        #: draw from the start; a look at the loop decides (APART, or in step for good).
        self.reshuffles = None if unwatched or threads is not None else reshuffler(kind)
        quiet = (workers or inert) and self.reshuffles is None
        self.state = Watch.CLEAR if quiet or unwatched else Watch.WATCHING
        self.in_step = self.state is Watch.WATCHING
        #: Pulls go through :meth:`pull` (any state but CLEAR: counted, judged or checked).
        self.watched = self.state is not Watch.CLEAR
        self.judged = 0
        self.drew: tuple[str, ...] = () if self.reshuffles is None else (TORCH,)
        self._reported = False
        #: What the loop drew from between two batches, where no pull ran meanwhile.
        self.loop_drew: set[str] = set()
        #: Such looks at the loop since the watch last went in step (WATCHING or RECHECK).
        self.loop_seen = 0
        #: Where a draw of the loop's from the source's generators was seen (APART, RECHECK).
        self.caught: str | None = None
        self._pulls = 0  # pulls made through :meth:`pull`, ended
        self._pulling = False  # one is running now
        #: (pulls ended, snapshot) when the loop took its last batch, with no pull running.
        self._handed: tuple[int, Snapshot] | None = None
        #: The generators where the last pull left them (APART, RECHECK); None: not known.
        self._left: Snapshot | None = None
        self._apart_pulls = 0  # pulls since the watch last went APART
        self.was_apart = False  # batches of a source that draws were prefetched
        self._told_ahead = False  # see ahead_of_the_loop
        self._trial: Trial | None = None  # the last trial handed out (:meth:`trial`)
        #: Escaping calls noted in loading threads before this watch began (see :meth:`message`).
        self._escapes_before = escapes_noted()
        #: A trial was judged clear: the threads loaded samples in parallel (:meth:`_cleared`).
        self._in_parallel = False
        #: Draws escaped samples that the threads had loaded in parallel (see :meth:`pull`).
        self.escaped_in_parallel = False
        #: (epoch, batches pulled) -> the source's generators' states then (states_after).
        self._after: collections.OrderedDict[tuple[int, int], dict[str, Any]] = (
            collections.OrderedDict()
        )
        #: Whether a resume would pull the batches before a state (not skip them through a
        #: sampler): only then are the states before each pull of use (``states_before``).
        self.keeps_before = not kind.skippable
        #: (epoch, batches pulled) -> those states as that batch's pull began (states_before).
        self._before: collections.OrderedDict[tuple[int, int], dict[str, Any]] = (
            collections.OrderedDict()
        )
        #: Serialises the state's changes made from the loop's thread and the producer's.
        self._lock = threading.Lock()
        #: An epoch's first pull can be judged: nothing but the user's per-batch code can draw
        #: in it (then prefetching starts after the very first batch, as without the watch).
        self.first_judged = _quiet_start(kind)
        #: Under threads=, the DataLoader whose samples load here (see :data:`_ESCAPING`).
        self._loader = kind.inner if threads is not None else None
        #: Its samples' escaping draws were seen by an earlier prefetcher over it.
        self.remembered = False
        escaped = _escaping(self._loader)
        if escaped and self.state is Watch.WATCHING:
            self.drew, self.remembered = escaped, True
            self._to(Watch.DRAWS)  # one sample at a time from the first: the same every run

    def pull(
        self,
        pull: Callable[[], M],
        *,
        first: bool,
        ahead: bool = False,
        at: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> M:
        """Call ``pull()`` (in step, or APART); judge it unless it is an epoch's ``first``.

        An epoch's first pull is judged too where the source's start is known to draw
        nothing (:func:`_quiet_start`), unless its batch was pulled ``ahead``, when the epoch
        was opened (a resumed one: see ``TakenAhead``): then this pull pulls nothing to judge.
        Without threads, a source seen drawing waits for a look at the loop between two
        batches (:meth:`step_seen`), which decides whether it may be prefetched. ``at()``,
        after the pull: (the epoch, its batches pulled), under which the source's generators
        are recorded once it is prefetched (:meth:`states_after`).
        """
        state = self.state
        if state is Watch.APART or state is Watch.RECHECK:
            return self._pull_apart(pull, at)
        if self.drew and self.keeps_before and self.threads is None and not (first and ahead):
            return self._pull_kept(pull, at)  # in step: decided by step_seen, or for good
        if (first and (ahead or not self.first_judged)) or state is not Watch.WATCHING:
            return self._counted(pull)
        if self.drew:
            return self._counted(pull)  # drew: decided by step_seen, or a trial saw it draw
        before = snapshot()
        message = self._counted(pull)
        if self.drew:
            return message  # a trial of its samples saw them draw (:meth:`saw`)
        after = snapshot()
        drew = moved(before, after)
        if drew:
            self.drew = drew
            if self.threads is not None:
                self._to(Watch.DRAWS)  # its samples' draws escaped their own generators
                # Moved after a trial's first sample was judged clear: by the samples the
                # threads loaded, in their order (said in the warning). Before the trial began
                # (a batch sampler that draws, in this thread), the draws were in order.
                trial = self._trial
                if trial is not None and trial.drew == () and moved(trial.before, after):
                    self.escaped_in_parallel = True
                    if not self.transform:  # else perhaps the transform's, not the loader's
                        _remember_escaping(self._loader, drew)
        else:
            self.judged += 1
            if self.judged >= JUDGED_PULLS:
                self._to(Watch.CLEAR)
        return message

    def _counted(self, pull: Callable[[], M]) -> M:
        self._pulling = True
        try:
            return pull()
        finally:
            # Counted before it is marked ended: a look read between the two must not pass.
            self._pulls += 1
            self._pulling = False

    def _pull_kept(self, pull: Callable[[], M], at: Callable[[], tuple[int, int]]) -> M:
        """A pull of a source known to draw, in step: its generators' states kept before it."""
        kept = states_of(self.drew)
        message = self._counted(pull)
        self._remember(self._before, at(), kept)
        return message

    def _remember(
        self,
        store: collections.OrderedDict[tuple[int, int], dict[str, Any]],
        key: tuple[int, int],
        states: dict[str, Any] | None,
    ) -> None:
        """Keep ``states`` under ``key`` (none where they cannot be saved), the last ones."""
        if states is None:
            return
        store[key] = states
        while len(store) > KEPT_STATES:
            store.popitem(last=False)

    def states_before(self, epoch: int, batches: int) -> dict[str, Any] | None:
        """The source's generators' whole states as the pull of batch ``batches`` began.

        Recorded for a source known to draw, pulled in step or prefetched (not under
        ``threads=``): a source that holds a batch it took ahead (timm's ``PrefetchLoader``
        yields batch k once it took and augmented batch k + 1) drew that next batch's numbers
        in the pull of the last batch handed out, from these states. A resumed run that pulls
        the batches before a state sets them before it pulls the last of them (see
        ``EpochSource._replay``). None where not recorded.
        """
        return self._before.get((epoch, batches))

    def states_after(self, epoch: int, batches: int) -> dict[str, Any] | None:
        """The source's generators' whole states right after batch ``batches`` of ``epoch``.

        Recorded as each batch is pulled ahead (APART, RECHECK), the last ones kept: what a
        state saved after that batch needs, so that a resumed run draws on from there, as
        the uninterrupted one did. None where not recorded.
        """
        return self._after.get((epoch, batches))

    def _pull_apart(self, pull: Callable[[], M], at: Callable[[], tuple[int, int]]) -> M:
        """A pull of a source that draws, prefetched: it must start where the last one ended.

        A draw from the source's generators between two pulls was made by someone else (the
        loop's step, another loader's ``iter()``): the loop is seen drawing from them, and
        the watch goes in step for good (see :meth:`caught_drawing`).
        """
        left, before = self._left, snapshot()
        kept = states_of(self.drew, before) if self.keeps_before else None  # NumPy's read now
        if left is not None and self.state is not Watch.DRAWS:
            between = [g for g in moved(left, before) if g in self.drew]
            if between:
                self.caught_drawing(between, "between two batches loaded ahead")
        message = self._counted(pull)
        self._left = left = snapshot()
        key = at()
        self._remember(self._after, key, states_of(self.drew, left))
        self._remember(self._before, key, kept)
        self._apart_pulls += 1
        if self.state is Watch.APART and self._apart_pulls >= RECHECK_PULLS:
            with self._lock:
                if self.state is Watch.APART:
                    self._to(Watch.RECHECK)  # to see the loop alone between two batches again
        return message

    def handed_out(self) -> None:
        """The loop takes a batch now (in step): what it draws until it asks again is its own."""
        if self.threads is None and not self._pulling:
            pulls = self._pulls
            self._handed = (pulls, snapshot())

    def step_seen(self) -> bool:
        """The loop asks for the next batch (in step): see what it drew since it took the last.

        Returns whether the source is still pulled in step (:attr:`in_step`).

        Only a look where no pull ran in between counts (a pull's own draws would read as the
        loop's). Once the source is known to draw and the loop was seen at least once since
        the watch went in step: from none of the same generators, the source is prefetched
        (APART); from one of them, it stays in step for good (DRAWS, reported).
        """
        handed, self._handed = self._handed, None
        if handed is None or self.threads is not None:
            return self.in_step
        now = snapshot()
        if self._pulling or self._pulls != handed[0]:
            return self.in_step  # a pull ran meanwhile: not the loop's draws alone
        self.loop_drew.update(moved(handed[1], now))
        self.loop_seen += 1
        if not self.drew or self.state not in (Watch.WATCHING, Watch.RECHECK):
            return self.in_step
        shared = [g for g in self.drew if g in self.loop_drew]
        if shared:
            self.caught_drawing(shared, "between two batches, as the source does")
        else:
            with self._lock:  # a pull may have caught the loop drawing meanwhile: that stays
                if self.state in (Watch.WATCHING, Watch.RECHECK):
                    self._to(Watch.APART)
        return self.in_step

    def caught_drawing(self, generators: list[str], where: str) -> None:
        """The loop drew from the source's ``generators``: in step for good, reported."""
        with self._lock:
            if self.caught is None:
                self.caught = f"{' and '.join(generators)}, {where}"
            self.loop_drew.update(generators)
            self._to(Watch.DRAWS)

    def ahead_of_the_loop(self) -> None:
        """A state saved after a prefetched source drew cannot set its generators back: warn.

        The source's generators were drawn for the batches loaded ahead: a checkpoint that
        saves them now holds them ahead of the plain loop's. A state saved inside an epoch
        holds the states after its last batch (:meth:`states_after`), which a resumed run sets
        back; one saved at an epoch's start or end, over a stateful source, or with
        torch.cuda's generator among the source's, cannot: then a run resumed from it would
        draw other values for the batches after the state than the uninterrupted run. Once.
        """
        if not self.was_apart or self._told_ahead:
            return  # (after a catch, batches loaded ahead before it may still be queued)
        self._told_ahead = True
        if getattr(_context, "unreported", False):
            return
        what = " and ".join(self.drew)
        warn(
            f"nostall: state_dict() while batches of {_who(self.kind)} are loaded ahead: it "
            f"draws from {what}, and your loop from none of them, so each batch draws what "
            f"the plain loop draws, but {what} may now be ahead of your loop by the batches "
            f"loaded ahead. Saved with your checkpoint, it would make a resumed run draw other "
            f"values for the batches after this state than the uninterrupted run. To resume "
            f"with the "
            f"same draws, give the draws a seeded generator of their own (e.g. "
            f"torch.rand(..., generator=g) with g = torch.Generator().manual_seed(0)), or load "
            f"with threads=2 (each sample's draws follow its place in the epoch, also after a "
            f"resume)",
            GlobalDrawsWarning,
        )

    def forget_left(self) -> None:
        """An epoch was opened in the loop's thread: its draws come before the next pull.

        Nor is the look at the loop since its last batch the loop's alone any more: opening
        draws (a DataLoader's base seed, a resumed epoch's states set back) without a pull.
        """
        self._left = None
        self._handed = None

    def _to(self, state: Watch) -> None:
        self.state = state
        self.in_step = state in (Watch.WATCHING, Watch.DRAWS, Watch.RECHECK)
        self.watched = state is not Watch.CLEAR
        if state is Watch.RECHECK or state is Watch.WATCHING:
            self.loop_seen = 0
        if state is Watch.APART:
            self._apart_pulls, self.was_apart = 0, True

    def trial(self) -> Trial | None:
        """A :class:`Trial` for the samples started now, or None to load them one at a time.

        Only while it is not known whether the source draws, and with threads to fetch in
        parallel (``threads=1`` would gain nothing, and fetch twice a source that draws), and
        without a ``timeout=`` (see ``__init__``).
        """
        if self.state is not Watch.WATCHING or (self.threads or 0) < 2 or not self.trials:
            return None
        self._trial = Trial(self.saw, self._cleared)
        return self._trial

    def _cleared(self) -> None:
        """A trial's first sample drew nothing: the threads load the rest of its batches."""
        self._in_parallel = True

    def saw(self, drew: tuple[str, ...]) -> None:
        """A trial's samples drew from ``drew``: in step for good, reported at the next pull."""
        if self.state is Watch.WATCHING:
            self.drew = drew
            self._to(Watch.DRAWS)
            # Batches loaded in parallel before (an epoch's first pull, not judged) may have
            # drawn in the threads' order.
            self.escaped_in_parallel = self._in_parallel
            _remember_escaping(self._loader, drew)  # a sample's own draw, seen alone

    def report(self) -> None:
        """Warn once, at the user's line, that the source draws (loop's thread, after a pull)."""
        if self.state is not Watch.DRAWS or self._reported:
            return
        self._reported = True
        if not getattr(_context, "unreported", False):
            warn(self.message(), GlobalDrawsWarning)

    def message(self) -> str:
        """What drew, what nostall does about it, what it costs, and the fix."""
        if self.reshuffles is not None:
            return _reshuffle_message(self.kind, self.reshuffles, self.was_apart)
        what = " and ".join(self.drew)
        who = _who(self.kind) + (", or the transform= given to nostall" if self.transform else "")
        if self.threads is not None:
            done = (
                f"in a way nostall cannot give each sample a generator of its own for (a torch "
                f"function that takes no generator=, such as F.dropout; a random op on a CUDA "
                f"tensor; a function bound before nostall started, such as `from random import "
                f"randint`; the generator object itself), so with threads={self.threads} those "
                f"draws would come in whatever order the loading threads and your loop run. "
                f"nostall loads this loader's samples one at a time instead, in your loop's "
                f"thread and only when the loop asks for a batch: the same draws on every run "
                f"from here on, but nothing is loaded in parallel or ahead"
            )
            if self.escaped_in_parallel:
                done += (
                    " (the batches loaded before this was seen had been loaded by the threads "
                    "in parallel, each batch's first sample drawing nothing: their draws that "
                    "escaped came in the order the threads ran, and may differ from run to run)"
                )
            fix = (
                "To load with threads, draw through torch.rand/torch.randint/torch.randn, "
                "Tensor.uniform_, random.random or np.random.rand looked up when called (under "
                "threads= each sample then draws from a generator of its own, the same on every "
                "run), or from torch.thread_safe_generator(); or leave threads out and load in "
                "worker processes (num_workers=2: each worker draws from its own seed, "
                "reproducibly, though not the values num_workers=0 draws)"
            )
        else:
            done = (
                "so loading it ahead in a background thread would interleave those draws with "
                "your step's own (dropout) in whatever order the threads run. nostall loads each "
                "batch only when your loop asks for it, as the DataLoader itself does: the same "
                "draws as without nostall, but nothing is fetched ahead"
            )
            fix = (
                "To prefetch, give the draws a seeded generator of their own (e.g. "
                "DataCollatorForLanguageModeling(..., seed=0), or torch.rand(..., generator=g) "
                "with g = torch.Generator().manual_seed(0)), or load with threads "
                "(nostall.prefetch(loader, threads=2): each sample draws from a generator of "
                "its own, in parallel and reproducibly) or in worker processes "
                "(DataLoader(num_workers=2): each worker draws from its own seed); either way "
                "not the values num_workers=0 draws"
            )
        if self.threads is None and is_timm_prefetch_loader(self.kind.source):
            fix = f"{TIMM_FIX}. {fix}"
        where = (
            "by an earlier prefetcher over this DataLoader"
            if self.remembered
            else "while loading a batch"
        )
        seen = f"seen {where}; another thread of yours drawing then looks the same"
        call = escape_since(self._escapes_before) if self.threads is not None else ""
        if call:
            seen += f"; one such call: {call}, in a loading thread"
        if self.caught is not None and self.threads is None:
            done = (
                f"and so does your loop: it drew from {self.caught} (your step, or another "
                f"loader's iter()), so loading ahead in a background thread would interleave "
                f"the two in whatever order the threads run. nostall loads each batch only when "
                f"your loop asks for it from now on, as the DataLoader itself does: the same "
                f"draws as without nostall, but nothing is fetched ahead"
            )
            if self.was_apart:
                done += (
                    " (the batches it had loaded ahead up to the one it saw this at, and "
                    "possibly the next, drew in another order than without nostall)"
                )
        return f"nostall: {who} draws from {what} ({seen}), {done}. {fix}."


#: DataLoaders whose samples' draws escaped their own generators under ``threads=``, and from
#: what: a later prefetcher over one (a prefetcher made each epoch) loads its samples one at a
#: time from its first batch, instead of loading its first batch in parallel to find out again.
_ESCAPING: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _escaping(loader: Any) -> tuple[str, ...]:
    """What ``loader``'s samples were seen drawing from, past the routing (none: not seen)."""
    if loader is None:
        return ()
    try:
        return _ESCAPING.get(loader, ())
    except TypeError:  # not hashable, or no weak reference to it
        return ()


def _remember_escaping(loader: Any, drew: tuple[str, ...]) -> None:
    if loader is not None:
        with contextlib.suppress(TypeError):
            _ESCAPING[loader] = drew


def quiet_after_start(loader: Any) -> bool:
    """Whether ``loader``'s index sampler draws from no global generator after its first item.

    torch's own samplers draw (if at all) when their iterator starts, then yield from what
    they drew or from their own generator: asking them for a later batch's indices ahead of
    the loop moves no draw. Anything else (a sampler of the user's) may draw per batch.
    """
    sampler = index_sampler(loader)
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    return type(sampler) in (*_OWN_GENERATOR, SequentialSampler, DistributedSampler, list, tuple)


#: Samplers that draw nothing from the global generators when their iterator starts, provided
#: they have a generator of their own (``generator``; a DistributedSampler always seeds one).
_OWN_GENERATOR = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def reshuffler(kind: SourceKind) -> str | None:
    """Which sampler of the source's loader draws an order again in the middle of an epoch.

    None for torch's own index samplers: they draw (if at all) when the epoch's iterator
    starts, which nostall does where a plain loop does. An endless index sampler (one without
    a length: it repeats its passes) that holds one of torch's random samplers without a
    generator of its own starts that one again at whichever batch reaches a new pass: timm's
    ``MultiEpochsDataLoader`` iterates one ``_RepeatSampler`` over all its epochs, and each
    pass's order is drawn from torch's global generator there (with workers, in the main
    process, as it puts the pass's first indices to a worker, a few batches before the
    previous pass ends). The loader is the source, or the one a wrapper holds (timm's
    ``PrefetchLoader``). Returns the index sampler's type name.
    """
    loader = kind.map_style_maker
    if loader is None:
        return None
    outer = index_sampler(loader)
    if type(outer) in _TORCH_INDEX_SAMPLERS or hasattr(type(outer), "__len__"):
        return None
    sampler = outer
    for _ in range(3):  # the repeater, a batch sampler, the random sampler
        sampler = getattr(sampler, "sampler", None)
        if isinstance(sampler, _OWN_GENERATOR) and sampler.generator is None:
            return type(outer).__qualname__
        if sampler is None:
            return None
    return None


#: torch's index samplers, which draw (if at all) only when the epoch's iterator starts.
_TORCH_INDEX_SAMPLERS = (
    BatchSampler,
    SequentialSampler,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    DistributedSampler,
)


def _reshuffle_message(kind: SourceKind, sampler: str, was_apart: bool) -> str:
    """The warning for a source whose sampler draws its orders mid-epoch (:func:`reshuffler`)."""
    loader = kind.loader if kind.loader is not None else kind.held
    who = type(loader).__qualname__ + ("" if kind.loader is not None else f" (in {kind.name})")
    before = (
        " (the orders it drew while loading ahead, before your loop was seen drawing, may "
        "differ from the plain loop's)"
        if was_apart
        else ""
    )
    return (
        f"nostall: the sampler of {who}, {sampler}, starts its random sampler again in the "
        f"middle of an epoch, drawing each pass's order from torch's global generator at "
        f"whichever batch reaches it (timm's MultiEpochsDataLoader does, a few batches before "
        f"each epoch ends), and your loop draws from that generator too (your step: dropout "
        f"on the CPU, say). Loading ahead in a background thread would draw those orders at a "
        f"moment that depends on the threads, so each epoch's order would differ from the "
        f"plain loop's and from run to run. nostall loads each batch only when your loop asks "
        f"for it, as the DataLoader itself does: the same orders as without nostall, but "
        f"nothing is fetched ahead{before}. To prefetch, give the random sampler a seeded "
        f"generator of its own (e.g. loader.sampler.generator = "
        f"torch.Generator().manual_seed(seed)), or use a plain DataLoader with "
        f"persistent_workers=True"
    )


def _quiet_start(kind: SourceKind) -> bool:
    """Whether the first batch of a ``source``'s epoch draws only what every batch draws.

    True for a plain ``DataLoader`` over a map-style dataset whose sampler draws nothing from
    the global generators when it starts: sequential, distributed, or random with its own
    ``generator=``. False for anything else: a ``RandomSampler`` without a generator draws
    its order from torch's at the first batch, as an iterable dataset or a generator may,
    once per epoch, where the plain loop draws it too.
    """
    if kind.loader is None or not kind.map_style:
        return False
    if not kind.torch_iteration:
        return False
    sampler = index_sampler(kind.loader)
    if type(sampler) is BatchSampler:
        sampler = sampler.sampler
    if isinstance(sampler, (SequentialSampler, DistributedSampler)):
        return True
    return isinstance(sampler, _OWN_GENERATOR) and sampler.generator is not None


def _who(kind: SourceKind) -> str:
    """The code that may have drawn, as the warning names it."""
    source = kind.loader
    if source is None:
        return f"the source ({kind.name})"
    dataset = f"the DataLoader's dataset ({type(source.dataset).__qualname__})"
    collate = source.collate_fn
    if collate in (default_collate, default_convert, None):
        return dataset
    name = getattr(collate, "__qualname__", None) or type(collate).__qualname__
    return f"{dataset} or its collate_fn ({name})"
