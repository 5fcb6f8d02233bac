"""Whether running ahead pays: the producer thread pulls ahead, or the consumer pulls inline.

Running ahead overlaps loading with the step, but on a GPU it is not free: every CUDA call
(pinning, a copy, an event, each kernel the step launches) releases the GIL, and with two
threads doing so each release hands the GIL to the other thread and each return waits to get
it back: a few microseconds per hand-over, several per batch. When the source and the step
are both short, those cost more than the overlap gains, and the serial loop's way (the
consumer pulls each batch itself when it asks) is faster. :class:`Overlap` measures both on
the consumer's own pace and keeps the faster.

Only who pulls changes; what is pulled does not: both ways go through the puller's lock, in
order, every batch once (see :class:`nostall._engine.producer.Puller`), so a switch is safe at any
batch.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Protocol


class Pulling(Protocol):
    """The puller of the current pass, as the overlap sees it."""

    #: The producer thread pulls nothing ahead while set (the consumer pulls each batch).
    inline: bool

    def set_inline(self, inline: bool) -> None:
        """Switch: wake a producer thread that may pull again."""


class Phase(enum.Enum):
    """What the next batches are for."""

    #: The choice is kept: batches counted down, nothing timed.
    HOLD = "hold"
    #: The way in use is timed, to compare with the other.
    FIRST = "first"
    #: Switched to the other way: the batches queued before the switch drain, untimed.
    SETTLE = "settle"
    #: The other way is timed, as many batches as the first.
    SECOND = "second"


class Overlap:
    """Chooses between running ahead and pulling inline, from the time batches take.

    The rule: after ``warmup`` batches, ``window`` batches (and at least ``window_s`` seconds)
    are timed the way in use, then, once the batches queued before the switch are handed out,
    as many the other way; the other way is taken only when it is at least ``margin`` faster.
    The choice is held for ``hold`` batches, doubled each time a probe confirms it (quadrupled
    when the other way was at least 1.5 times slower; up to ``max_hold``), then probed again.
    A second way already slower than the whole first window (plus ``margin``), or, after
    ``window`` batches, 1.5 times slower a batch (after a quarter of them, twice as slow),
    stops at once: a probe of the worse way costs at most about one window, a clearly worse
    one about ``window`` batches, a far worse one a quarter of that.

    Invariants:
        * Per batch while holding, one decrement and one comparison (:meth:`handed_out`);
          timing only while probing, at every batch of the probe.
        * A pass that ends, errs or starts (an epoch boundary, a resume) interrupts a probe:
          it starts again, timing nothing across the boundary (:meth:`interrupted`).
        * ``inline`` is the way in use; every new pass's puller is set to it.
    """

    def __init__(
        self,
        *,
        warmup: int = 16,
        window: int = 32,
        window_s: float = 0.02,
        margin: float = 0.05,
        hold: int = 256,
        max_hold: int = 1 << 16,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.warmup, self.window, self.window_s, self.margin = warmup, window, window_s, margin
        self.clock = clock
        self.base_hold, self.max_hold = hold, max_hold
        self.hold = hold
        #: The way in use.
        self.inline = False
        self.phase = Phase.HOLD
        #: Batches before :meth:`turn` is called again.
        self.left = warmup
        self._start = 0.0
        self._first_n = 0  # batches the first window timed
        self._first_s = 0.0  # and how long they took
        self._settle = 0
        #: Each probe's outcome, latest last: (the way in use, seconds per batch ahead, inline).
        self.probes: list[tuple[bool, float, float]] = []
        #: Times the puller was switched (to probe, to go back, to keep the other way).
        self.switches = 0

    def fix(self, inline: bool) -> None:
        """Pull one way from the next pass on, never probing the other (for measurements)."""
        self.inline, self.phase, self.left, self.hold = inline, Phase.HOLD, 1 << 62, 1 << 62

    def handed_out(self, puller: Pulling, depth: int) -> None:
        """One batch was handed out by the pass of ``puller``, channel ``depth`` deep."""
        self.left -= 1
        if self.left <= 0:
            self.turn(puller, depth)

    def turn(self, puller: Pulling, depth: int) -> None:
        """The countdown reached 0: move to the next phase."""
        now = self.clock()
        phase = self.phase
        if phase is Phase.HOLD:
            self.phase, self.left, self._start, self._first_n = Phase.FIRST, 1, now, 0
        elif phase is Phase.FIRST:
            self._first_n += 1
            self.left = 1
            if self._first_n >= self.window and now - self._start >= self.window_s:
                self._first_s = now - self._start
                self.phase = Phase.SETTLE
                self.left = depth + 1  # what was queued the first way, and one in flight
                puller.set_inline(not self.inline)
                self.switches += 1
        elif phase is Phase.SETTLE:
            self.phase, self.left, self._start, self._settle = Phase.SECOND, 1, now, 0
        else:
            self._settle += 1
            self.left = 1
            elapsed = now - self._start
            first = self._first_s / self._first_n
            n = self._settle
            if (
                elapsed > self._first_s * (1 + self.margin)
                or (n >= self.window and elapsed > 1.5 * first * n)
                or (n >= max(4, self.window // 4) and elapsed > 2 * first * n)
            ):
                # Lost already: slower than the whole first window; or, after a window's worth
                # of batches, 1.5 times slower a batch; or, after a quarter of it, twice.
                self._decide(puller, first, None)
            elif self._settle >= self._first_n:
                self._decide(puller, self._first_s / self._first_n, elapsed / self._settle)

    def _decide(self, puller: Pulling, first: float, second: float | None) -> None:
        """Keep the faster way (the other only by ``margin``); hold it, longer when confirmed."""
        was_inline = self.inline
        if second is None:  # the second way lost before its window ended
            keep_inline, clear = was_inline, True
        else:
            ahead, inline = (second, first) if was_inline else (first, second)
            # The way in use is left only for one faster by the margin: no flapping between
            # two ways that take about as long.
            if was_inline:
                keep_inline = not ahead < inline * (1 - self.margin)
            else:
                keep_inline = inline < ahead * (1 - self.margin)
            clear = max(ahead, inline) >= 1.5 * min(ahead, inline)
            self.probes.append((was_inline, ahead, inline))
        if keep_inline == was_inline:
            # Confirmed: probe less often, far less when the other way was far worse.
            self.hold = min(self.hold * (4 if clear else 2), self.max_hold)
        else:
            self.hold = self.base_hold
            self.inline = keep_inline
        if puller.inline != self.inline:
            puller.set_inline(self.inline)
            self.switches += 1
        self.phase, self.left = Phase.HOLD, self.hold

    def interrupted(self, puller: Pulling | None) -> None:
        """A pass started, ended or erred: no timing crosses it; the way in use goes on."""
        if puller is not None and puller.inline != self.inline:
            puller.set_inline(self.inline)
        if self.phase is not Phase.HOLD:
            self.phase, self.left = Phase.HOLD, self.warmup
