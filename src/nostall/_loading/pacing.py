"""When the producer of a threaded epoch starts its next pull: after the consumer's launches.

A training step begins as ``next()`` hands it its batch; on a GPU the step then launches its
kernels, each torch op giving up the GIL and taking it back, and waits for the device without
it. ``threads=`` loads in this process: a loading thread that wants the GIL (a decoder's Python
between its GIL-free calls) takes it at one of those ops, and the launching thread waits for
it back. A refill started at the hand-off, as a slot frees, lands its loading on the launch
phase, and the launches take several times as long (measured 2-4x on 2 cores with the bench's
JPEG samples; about 1.0x once the loading started 5 ms later, with the same epoch time).

So while the consumer already holds its next batch in the queue, the producer waits before it
pulls: until the last hand-off plus the slack it can afford, the median of the recent steps
less the longest of the recent pulls. Invariants:

    * No wait while nothing is queued (the consumer would wait for this pull), nor before
      :data:`WINDOW` steps and pulls have been seen, nor within :data:`WINDOW` steps of the
      consumer finding nothing queued (loading keeps up only just: the steps seen are
      forgotten then), nor when the slack is not positive.
    * A wait ends early when the consumer finds nothing queued (:meth:`Pacer.hurry_up`) or the
      channel is let go; it never outlasts one step from the hand-off. When the consumer
      takes its last queued batch meanwhile (:meth:`Pacer.drained`), the wait is taken again
      from that hand-off with the shorter of the median and that last step, and ends at the
      earlier of the two: a step much shorter than the recent ones (after a slow warm-up)
      would otherwise find nothing queued while the pull still waited. Not at the wait's
      start: a last step a little short (its hand-off delayed by the one before) would move
      the pull into the launches.
    * The pull then still ends before the consumer needs its batch: started at the hand-off
      plus the slack, a pull as long as the longest recent one ends a (median) step after
      that hand-off, and the consumer needs it a step later (it has the queued batch for the
      step between). So a pull makes the consumer wait only when it takes a whole step longer
      than any of the last :data:`WINDOW`; one that ends late shortens the next wait (the
      next pull never starts before the last one ended), so lateness does not add up. The
      longest pull, not the median: on a busy machine pull times have a long tail (2 cores
      at load 3-5: median pulls of 12-30 ms, the longest of 8 up to 40 ms). What is loaded,
      and in what order, is unchanged; only when it starts moves.
    * One pacer serves every epoch of a prefetcher (it is kept with its loading threads): the
      steps and pulls it saw carry over, and no epoch starts unpaced.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import threading
import time
from collections.abc import Callable

#: Steps (hand-off to hand-off) and pulls the slack is taken over; no wait before that many.
WINDOW = 8


class Pacer:
    """The hand-offs and pull times of one channel, and when the next pull may start."""

    def __init__(self) -> None:
        #: When the consumer got each of its last batches (``time.monotonic()``), since it
        #: last found nothing queued.
        self.handoffs: collections.deque[float] = collections.deque(maxlen=WINDOW + 1)
        #: Seconds each of the producer's last pulls took.
        self.pulls: collections.deque[float] = collections.deque(maxlen=WINDOW)
        #: Set when a waiting producer must pull now (the consumer found nothing queued, or
        #: the channel was let go) or look again at when (the consumer emptied the queue).
        self.hurry = threading.Event()

    def handed_off(self) -> None:
        """The consumer got a batch (called in its thread by ``Channel.get``)."""
        self.handoffs.append(time.monotonic())

    def hurry_up(self) -> None:
        """The consumer waits (nothing queued), or the channel is let go: pull now.

        The steps seen are forgotten: a step that included a wait is not a step, and pacing
        starts again only after :data:`WINDOW` steps without one.
        """
        self.handoffs.clear()
        self.hurry.set()

    def drained(self) -> None:
        """The consumer took its last queued batch: a waiting producer takes its wait again.

        Called in the consumer's thread, after :meth:`handed_off`: the next pull is the one
        the consumer waits for if its next step is as short as this last one.
        """
        self.hurry.set()

    def pulled(self, seconds: float) -> None:
        """The producer's pull took ``seconds``."""
        self.pulls.append(seconds)

    def start_at(self, drained: bool = False) -> float | None:
        """When the next pull may start (``time.monotonic()``), or None: at once.

        ``drained``: the last hand-off emptied the queue; its step, if shorter than the
        median, is the one allowed (the next may be as short).
        """
        # Copied whole under the GIL (floats: no Python runs meanwhile), while the consumer
        # may append.
        handoffs, pulls = list(self.handoffs), list(self.pulls)
        if len(handoffs) <= WINDOW or len(pulls) < WINDOW:
            return None
        steps = [b - a for a, b in itertools.pairwise(handoffs)]
        step = statistics.median(steps)
        slack = (min(step, steps[-1]) if drained else step) - max(pulls)
        return handoffs[-1] + slack if slack > 0 else None

    def wait(self, queued: Callable[[], bool]) -> None:
        """In the producer, holding a slot: wait until :meth:`start_at`, if ``queued()``.

        ``hurry`` is cleared before the hand-offs and ``queued()`` (a batch is queued and the
        channel not let go) are read: a consumer that hands off, drains the queue or finds it
        empty sets it after, so it is not missed. Woken, the start is taken again (None once
        the consumer waited or the channel was let go: the steps were forgotten), and the
        earlier of the two stands.
        """
        self.hurry.clear()
        start = self.start_at()
        if start is None or not queued():
            return
        while (left := start - time.monotonic()) > 0:
            if not self.hurry.wait(left):
                return  # the start came
            self.hurry.clear()
            again = self.start_at(drained=True)
            if again is None:
                return
            start = min(start, again)
