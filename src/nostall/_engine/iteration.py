"""One pass over the source: the iterator, its lifecycle, and what passes hand on.

A :class:`PrefetchIterator` is what ``iter(prefetcher)`` returns. It starts a producer thread
(:mod:`nostall._engine.producer`) on its first ``next()``, takes batches, errors and the epoch's
end from its channel (:mod:`nostall._engine.channel`) in order, and hands each batch out through
the staging (:mod:`nostall._staging.choose`).
Consecutive passes of one Prefetcher share a :class:`~nostall._engine.lineage.Lineage`: the
position to resume from, the producer that runs ahead across epochs.

Lifecycle of an iterator (:class:`Lifecycle`)::

    CREATED --first next()--> RUNNING --the epoch's end taken--> DONE
       |                         |
       +------ close(), a newer iter(), load_state_dict(), KeyboardInterrupt --> STOPPED
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from .._exceptions import (
    NostallError,
    PrefetcherClosedError,
    PrefetchTimeoutError,
    add_note,
    is_noted,
)
from .._exit import track
from .._sources.checks import describe, warn_drawn_ahead, warn_if_hidden_from_framework
from .._staging.cuda import CudaStaging
from .._warn import warn
from . import producer_thread
from .autodepth import auto_depth_limit
from .channel import BATCH, END, ERROR, Channel, Message
from .lineage import Lineage
from .producer import Puller
from .producer_thread import produce

if TYPE_CHECKING:
    from .._staging.base import Staging
    from .profile import StallRecorder
    from .settings import Settings

T = TypeVar("T")

_THREAD_IDS = itertools.count()


class Owner(Protocol):
    """What an iteration takes from the Prefetcher that starts it (and nothing more).

    The source and the device are the lineage's (``epochs.source``) and the staging's.
    """

    _staging: Staging
    _lineage: Lineage
    _recorder: StallRecorder | None
    _settings: Settings


#: Why an iteration stops when a newer ``iter()`` of its Prefetcher replaces it.
REPLACED = "a newer iter() on the same Prefetcher replaced this iteration"


class Lifecycle(enum.Enum):
    """Where an iterator is (see the module docstring for the transitions)."""

    #: Made by ``iter()``; nothing fetched yet.
    CREATED = "created"
    #: Its producer runs; batches are taken from its channel.
    RUNNING = "running"
    #: The epoch's end was taken (``StopIteration``); a new ``iter()`` goes on.
    DONE = "done"
    #: Stopped before its end; ``next()`` raises ``PrefetcherClosedError``.
    STOPPED = "stopped"


class PrefetchIterator(Iterator[T]):
    """One iteration (an epoch) of a :class:`Prefetcher`; see there for the guarantees.

    States: created (nothing fetched) -> running -> done (the epoch ended or raised; ``next``
    raises ``StopIteration`` from then on) or stopped (closed, replaced or interrupted; ``next``
    raises :class:`~nostall.PrefetcherClosedError` saying why).
    """

    def __init__(self, owner: Owner, held_ahead: Callable[[], int] = lambda: 0) -> None:
        # Its parts, not a reference to the owner: the owner may be dropped while this runs,
        # and this object must be collectable on its own.
        self._settings = owner._settings  # frozen: the settings as this iteration began
        self._staging = owner._staging
        on_cuda = isinstance(self._staging, CudaStaging)
        #: Asked before each batch is taken: True while the consumer's stream captures a CUDA
        #: graph (then ``check_consumer`` raises). None off CUDA: nothing to ask.
        self._capturing = torch.cuda.is_current_stream_capturing if on_cuda else None
        #: Makes the consumer's stream wait for a batch (CUDA); None: the batch is ready.
        self._hand_out = self._staging.hand_out if on_cuda else None
        #: Batches moved in the consumer's thread as they are handed out (MPS).
        self._late = self._staging.late
        self._lineage = owner._lineage
        #: The process's fork count when the prefetcher was built (see ``LatestProducer``).
        self._forks = owner._lineage.producer.fork_generation
        #: Whether to pull ahead or inline, judged by the consumer's pace; None with a
        #: ``timeout=`` (the consumer pulls no batch itself then: a pull cannot time out).
        self._overlap = owner._lineage.overlap if self._settings.timeout is None else None
        self._recorder = owner._recorder
        #: Batches the caller took from this iteration and has not given its step yet (a
        #: framework's loop that fetches ahead): a state saved now does not count them.
        self.held_ahead = held_ahead
        self._state = Lifecycle.CREATED
        self._stopped_why = ""
        self._puller: Puller | None = None
        self._index = 0  # batches of this epoch handed out so far
        #: This thread's intra-op thread count, to give back to the process once the producer
        #: has set its own (torch keeps the last count set, in any thread, for new threads).
        self._threads: int | None = None
        #: The OS refused the producer thread at the last start: start it at the next next().
        self._launch_failed = False

    def __iter__(self) -> PrefetchIterator[T]:
        return self

    def __next__(self) -> T:
        """The next batch: what the loop's ``next()`` runs, for every batch.

        Its steady path (a batch, no error, no epoch boundary) is written out here, each
        rarer case in a method of its own: every call made between the GIL-free calls of the
        source and the staging lengthens a hand-over of the GIL (see :mod:`.overlap`).
        """
        try:
            capturing = self._capturing
            if capturing is not None and capturing():
                self._staging.check_consumer()  # raises: not while a CUDA graph is captured
            puller = self._puller
            if puller is None:
                puller = self._start_or_end()
            elif producer_thread.fork_generation != self._forks:  # forked() without its call
                self._lineage.producer.check_not_forked()
            elif self._launch_failed:
                self._launch(puller)
            paused = puller.paused_at
            if paused is not None and (self._lineage.epoch, self._index) >= paused:
                self._go_on_after_error(puller)  # the loop caught the error and asks for more
            if self._index == puller.expected:
                puller.ask_for_end()  # asked past the last batch: the source may now end
            draws = puller.epochs.draws
            timeout = self._settings.timeout
            if draws.in_step:  # the source may draw from the global generators
                # What the loop drew since the last batch may end that (it draws from
                # other generators): then the producer runs ahead from here on.
                if not draws.step_seen():
                    puller.channel.wake.set()
                else:
                    # A draw a pull saw is said here, at the user's line, before this call
                    # takes anything: a warning turned into an error (python -W error) then
                    # loses no batch, and the next call goes on (it is said once).
                    draws.report()
                    if puller.channel.empty():  # else a batch loaded ahead comes first
                        puller.want(wake=timeout is not None)
                    message = puller.channel.get(self._index, timeout, puller.pull_here)
                    batch_in_step: T = self._take(puller, message)
                    draws.handed_out()
                    return batch_in_step
            channel = puller.channel
            # Pulling inline (see Overlap): this thread pulls, as a plain loop does; what was
            # queued before the switch, or a pull the producer serves, comes through get().
            inline = puller.inline and channel.empty()
            pulled = puller.pull_here(wait=True) if inline else None
            if pulled is None:
                pulled = channel.get(self._index, timeout, puller.pull_here)
            kind, staged, epoch, state, hook = pulled
            if kind is BATCH and self._threads is None and not self._late:
                # A batch: _take, without its call.
                self._index = index = self._index + 1
                self._lineage.handed_out(epoch, index, state, staged.transform_state, hook)
                hand_out = self._hand_out
                batch: T = staged.batch if hand_out is None else hand_out(staged)
            else:
                batch = self._take(puller, pulled)
            del staged, pulled
            overlap = self._overlap
            if overlap is not None:
                overlap.left -= 1  # Overlap.handed_out, without its call
                if overlap.left <= 0:
                    overlap.turn(puller, puller.channel.depth)
            return batch
        except KeyboardInterrupt:
            # Wherever it landed (starting the epoch, waiting, or inside the source when this
            # thread pulled a batch itself), the iteration stops and its producer with it.
            self._stop("interrupted by KeyboardInterrupt")
            raise
        except PrefetchTimeoutError:
            puller = self._puller  # None: raised waiting for a previous producer
            timeout = self._settings.timeout
            if puller is not None and timeout is not None:
                self._lineage.producer.mark_stuck(puller, timeout)  # see let_go_of_stuck
            raise
        except (StopIteration, NostallError):
            raise
        except Exception as e:
            # Noted where it arose, unless it was. PyTorch's SIGCHLD handler raises a dead
            # DataLoader worker's error into this thread wherever it is: waiting, pulling a
            # batch itself, or right here, noting another error (at the first call below: so
            # no call comes before the try). The error raised last is what the loop gets;
            # Python chains the first as its context.
            error: Exception = e
            while True:
                try:
                    if not is_noted(error):
                        add_note(
                            error,
                            f"nostall: raised in the consumer thread during next() "
                            f"for batch {self._index} of this epoch",
                        )
                    break
                except Exception as again:
                    error = again
            if error is e:
                raise
            raise error  # noqa: B904  (raised while the first was noted: its context stays)

    @staticmethod
    def of(owner: Owner, held_ahead: Callable[[], int] = lambda: 0) -> PrefetchIterator[Any]:
        """A pass of ``owner``: recorded (:class:`RecordedIteration`) where it profiles."""
        kind = PrefetchIterator if owner._recorder is None else RecordedIteration
        return kind(owner, held_ahead)

    def _start_or_end(self) -> Puller:
        """No producer: start one on the first next(), else say why nothing more comes."""
        if self._state is Lifecycle.CREATED:
            return self._start()
        if self._state is Lifecycle.STOPPED:
            fix = "start a new one with iter(prefetcher)"
            if self._stopped_why == REPLACED:
                # zip(p, p), or an evaluation loop over the training prefetcher mid-epoch.
                fix = (
                    "one Prefetcher runs one iteration at a time (a DataLoader may run two, "
                    "but one source must not be pulled by two threads at once); to iterate "
                    "two at once, as zip(p, p) or a loop inside the epoch's loop does, give "
                    "the second its own prefetcher: nostall.prefetch(another_loader)"
                )
            raise PrefetcherClosedError(f"this iteration was stopped: {self._stopped_why}; {fix}")
        raise StopIteration

    def _take(self, puller: Puller, message: Message) -> T:
        """Hand out one message from ``puller``'s channel: a batch, an error, or the epoch's end."""
        kind, payload, epoch, state, hook = message
        lineage = self._lineage
        if self._threads is not None and puller.threads_set.is_set():
            torch.set_num_threads(self._threads)
            self._threads = None
        if kind is BATCH or kind is ERROR:
            self._index += 1
            if kind is ERROR:
                lineage.error_handed_out(epoch, self._index, state)
                if self._overlap is not None:
                    self._overlap.interrupted(puller)
                # One batch failed; the epoch goes on at the next next(), as a DataLoader's.
                raise payload
            if self._staging.late:
                # Moved and transformed here and now (MPS): the transform's checkpoint is the
                # one right after it.
                try:
                    batch = self._staging.hand_out(payload)
                except Exception:
                    # The batch failed, as one the producer failed on: counted as handed out.
                    lineage.advanced(epoch, self._index, state, self._staging.transform_state())
                    raise
                # (A KeyboardInterrupt leaves the position before this batch: never seen.)
                transform_state = self._staging.transform_state()
                lineage.handed_out(epoch, self._index, state, transform_state, hook)
                return batch  # type: ignore[no-any-return]
            lineage.handed_out(epoch, self._index, state, payload.transform_state, hook)
            if self._hand_out is None:
                return payload.batch  # type: ignore[no-any-return]  # off CUDA: nothing to wait for
            return self._hand_out(payload)  # type: ignore[no-any-return]
        if isinstance(payload, KeyboardInterrupt):
            raise payload  # from a pull in this thread: __next__ stops the iteration
        lineage.pass_ended(puller.channel.depth)
        if self._overlap is not None:
            self._overlap.interrupted(None)
        self._puller = None
        self._state = Lifecycle.DONE
        if kind is END:
            lineage.end_handed_out(puller, epoch, state, hook)
            raise StopIteration
        raise payload

    def _finish_if_complete(self) -> None:
        """Count an epoch complete once its ``len(source)`` batches were handed out.

        Frameworks such as Lightning take ``len(loader)`` batches and start the next epoch
        without asking for the ``StopIteration``. The epoch is complete all the same: counting
        it keeps the epoch number and the resume state right. The source is not asked for its
        end (a plain loop of that kind never asks either, and asking may draw random numbers).
        """
        puller = self._puller
        if self._state is not Lifecycle.RUNNING or puller is None:
            return
        if self._index != puller.expected:
            return
        self._stop("the epoch was complete (len(source) batches) when a new iter() began")
        self._state = Lifecycle.DONE
        self._lineage.epoch_complete(puller.epoch)

    @property
    def running(self) -> bool:
        """Whether its producer may still be fetching for it (started, not ended or stopped)."""
        return self._state is Lifecycle.RUNNING

    @property
    def depth(self) -> int:
        """Batches this iteration may fetch ahead (grows with ``depth="auto"``; kept at the end)."""
        if self._puller is not None:
            return self._puller.channel.depth
        if self._state is Lifecycle.CREATED or self._lineage.last_depth is None:
            depth = self._settings.depth
            return 1 if depth == "auto" else int(depth)
        return self._lineage.last_depth

    def close(self) -> None:
        """Stop this iteration and its producer (without waiting for it); idempotent."""
        self._stop("close() was called on it")

    def _start(self) -> Puller:
        lineage = self._lineage
        first = lineage.first_epoch()
        if first:
            epochs = lineage.epochs
            warn_if_hidden_from_framework(epochs.source, epochs.kind, self._settings.shard)
        ahead = lineage.take_ahead()
        if ahead is not None:
            # In step, it was opened when asked for; pulling inline, it is opened at the first
            # pull of this pass, in this thread, as a plain loop opens it: no warning then.
            opened = ahead.batches is not None or ahead.epoch in ahead.open_marks
            self._state, self._puller, self._index = Lifecycle.RUNNING, ahead, 0
            if self._overlap is not None:
                self._overlap.interrupted(ahead)
            # Warned of once the epoch is this iteration's: raised as an error, it loses
            # nothing, and the next next() takes the epoch's first batch.
            if opened and not lineage.epochs.draws.in_step:
                warn_drawn_ahead(lineage.epochs.kind)
            if not first:  # (nostall set this epoch ahead, or the loop did since)
                lineage.epochs.unasked.opened(lineage.epochs.kind, lineage.epoch)
            return ahead  # across epochs: this epoch is already being fetched
        # Two producers must never pull from one source: wait for the previous one. A timeout
        # here leaves this iteration as it was, so that next() can try again.
        lineage.producer.wait_ended(self._settings.timeout)
        # (An iteration stopped just after its producer opened the next epoch ahead leaves the
        # sampler at that epoch; that reads as an outside set_epoch, and is followed: a user who
        # set the same epoch on the sampler cannot be told apart, and must not get the old one.)
        outside = lineage.follow_outside_set_epoch()
        forward = lineage.epochs.across_epochs and not outside
        pending = lineage.take_pending_transform_state()
        if pending is not None:
            self._staging.load_transform_state(pending)
        epochs = lineage.epochs
        depth = self._settings.depth
        auto = depth == "auto"
        channel = Channel(
            1 if auto else int(depth),
            describe(epochs.source),
            max_depth=1 if auto else None,  # grows once the first batch shows its size
            pacer=epochs.pacer,
        )
        device = self._staging.device  # not self: the puller must not keep this alive
        puller = Puller(
            channel,
            self._staging,
            epochs,
            epoch=lineage.epoch,
            on_first_batch=(
                (lambda staged: channel.limit_growth(auto_depth_limit(staged.batch, device)))
                if auto
                else None
            ),
        )
        self._state = Lifecycle.RUNNING
        self._puller = puller
        if self._overlap is not None:
            self._overlap.interrupted(puller)  # before it starts: it pulls the way in use
        if lineage.carry_over(channel):
            return puller
        if lineage.exhausted:
            # The end first: the warning, made an error, then leaves the empty epoch to end.
            channel.put_ready((END, 0, lineage.epoch, None, None))
            warn(
                f"nostall: the source {describe(epochs.source)} is a one-shot iterator that is "
                f"exhausted, so this epoch is empty; pass a re-iterable source (a DataLoader, a "
                f"list, or an object whose __iter__ returns a new iterator) to iterate again",
                UserWarning,
            )
            return puller
        epochs.before_open()
        try:
            puller.open(lineage.epoch, forward=forward, outside=outside)
        except BaseException as e:
            self._puller, self._state = None, Lifecycle.DONE
            add_note(e, "nostall: raised by iter(source) at the first next() of this epoch")
            raise
        self._index = puller.pulled  # a resumed epoch starts after the batches already seen
        epochs.note_marks()  # as this open left them (it may have set the epoch)
        lineage.carry(puller)
        self._launch(puller)
        epochs.opened_here()  # last: a warning made an error leaves the epoch ready to go on
        if epochs.across_epochs and not first:
            epochs.unasked.opened(epochs.kind, lineage.epoch)
        return puller

    def _launch(self, puller: Puller) -> None:
        """Start a producer thread for ``puller`` (no other may be running for it)."""
        # Start this thread's intra-op pool now, with its own count: the producer sets one
        # thread for itself, and a pool started after that would read its count (1).
        self._threads = torch.get_num_threads()
        thread = track(
            threading.Thread(
                target=produce,
                args=(puller,),
                name=f"nostall-prefetch-{next(_THREAD_IDS)}",
                daemon=True,  # never keeps the interpreter alive; stopped by an atexit hook
            )
        )
        puller.channel.producing.set()  # before it starts: its end clears it
        try:
            thread.start()
        except RuntimeError as e:  # the OS refused a thread: the next next() tries again
            puller.channel.producing.clear()
            self._launch_failed = True
            add_note(e, "nostall: raised starting the producer thread; nothing was lost")
            raise
        self._launch_failed = False
        puller.channel.thread = thread
        self._lineage.producer.started(thread)

    def _go_on_after_error(self, puller: Puller) -> None:
        """The loop caught an error in one batch and asks for the next: resume producing.

        The producer paused (ended) after the error, so that a loop that stops there leaves
        nothing running; the source's iterator is still the puller's, and a new producer
        goes on from the batch after the failed one.
        """
        thread = puller.channel.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()  # it is pausing: it waits on nothing once after_error is set
        puller.go_on()
        if not puller.finished and not puller.stopped:
            self._launch(puller)

    def _stop(self, why: str) -> None:
        if self._state in (Lifecycle.DONE, Lifecycle.STOPPED):
            return
        self._state = Lifecycle.STOPPED
        self._stopped_why = why
        if self._puller is not None:
            self._lineage.pass_ended(self._puller.channel.depth)
            self._puller.stop(why)
            self._puller = None

    def __del__(self) -> None:
        # Runs when the consumer drops the iteration (break, del, garbage collection); only
        # signals, never joins, since a finaliser must not block.
        puller = self.__dict__.get("_puller")
        if puller is not None:
            self._lineage.pass_ended(puller.channel.depth)
            puller.stop()


class RecordedIteration(PrefetchIterator[T]):
    """A pass whose loop waits are recorded (``profile=True``), each ``next()`` timed."""

    def __next__(self) -> T:
        recorder = self._recorder
        assert recorder is not None  # made only with one (see PrefetchIterator.of)
        recorder.before_next()
        try:
            batch = super().__next__()
        except BaseException:
            recorder.end()
            raise
        recorder.after_next(batch)
        return batch
