"""What each epoch's order was drawn from, so that a resumed run draws it again.

A source's order is drawn from random generators (torch's global one, the sampler's or the
loader's ``generator=``) and the sampler's epoch. :class:`DrawnOrders` records them for each
epoch as it is opened, and sets them back when a saved state resumes one.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .._clients.fabric import IterCount
from .._sources.samplers import capture_rng, generators_of, sampler_epoch_of
from .._sources.sources import iterated_loader
from .._torch_compat import live_iterator

#: Epochs before the latest one opened whose records are kept: the producer may open several
#: short epochs ahead of a state saved in the first of them.
KEPT_EPOCHS = 16


class DrawnOrders:
    """The records of what one source's epoch orders were drawn from.

    Invariants:
        * ``drawn(e)`` is what epoch e's order was drawn from, once e is open (until
          e + KEPT_EPOCHS is opened, or e again). It is recorded before the order is drawn,
          together with setting the generators it is drawn from, under ``opening``: a reader
          that holds ``opening`` and finds no record of e knows that e's draws have not begun.
        * Across epochs the producer draws the next epoch's order from torch's global
          generator ahead of the consumer, at a moment that depends on the threads: a state
          saved in epoch e records that generator as e + 1's draw finds it
          (:meth:`next_draws_from`), and a resumed run draws e + 1 from it where its epochs
          draw from torch's generator at all.
    """

    def __init__(self, count: IterCount | None) -> None:
        #: Over Fabric's loader: its count of iter() calls, which sets the sampler's epoch.
        self.count = count
        self.captures: dict[int, dict[str, Any]] = {}
        self.opening = threading.Lock()
        #: (epoch, state, left): the epoch after a resumed one draws its order from torch's
        #: global generator in ``state``, as the saved state said, provided the generator is
        #: still as the resumed epoch ``left`` it (nothing else drew: see :meth:`opened`).
        self.follows: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def drawn(self, epoch: int) -> dict[str, Any] | None:
        """What ``epoch``'s order was drawn from, while it is kept."""
        return self.captures.get(epoch)

    def follow(self, epoch: int, state: torch.Tensor) -> None:
        """``epoch`` follows a resumed one: its order is drawn from torch's in ``state``.

        Provided nothing draws from torch's generator before ``epoch`` opens (see
        :meth:`opened`).
        """
        with self.opening:
            self.follows = (epoch, state, torch.get_rng_state())

    def forget_follow(self) -> None:
        """A state was loaded: no epoch follows a resumed one (yet)."""
        self.follows = None

    def next_draws_from(self, epoch: int) -> torch.Tensor:
        """torch's global generator state as epoch ``epoch + 1``'s order finds it when drawn.

        Across epochs the producer opens that epoch as soon as it reaches it, so a state saved
        in ``epoch`` may come before or after that draw, as the threads ran: as it was when
        that epoch was opened where it was already; as a resumed state said, where the epoch
        follows a resumed one; else as it is now, which is what the draw finds when nothing
        draws from it in between (a step that draws makes the order differ anyway: the README
        asks for the loader's own ``generator=`` then).
        """
        with self.opening:
            opened = self.captures.get(epoch + 1)
            if opened is not None:
                return opened["rng"]["torch"]  # type: ignore[no-any-return]
            if self.follows is not None and self.follows[0] == epoch + 1:
                return self.follows[1]
            return torch.get_rng_state()

    def opened(
        self,
        epoch: int,
        source: object,
        rng: dict[str, torch.Tensor] | None = None,
        **fields: Any,
    ) -> None:
        """Set the generators ``epoch``'s order is drawn from, and record them, as one step.

        ``source``: the source being opened (its own generators, its sampler's epoch).

        ``rng``: the states to draw it from (a resumed epoch); else the generators as they are,
        except where ``epoch`` follows a resumed one whose state said how torch's finds it, and
        nothing drew from torch's since the resumed epoch began: a step that draws makes the
        order differ anyway, and setting the generator under it would repeat its numbers.
        """
        with self.opening:
            follows, self.follows = self.follows, None
            if rng is not None:
                self.restore(source, rng)
            elif (
                follows is not None
                and follows[0] == epoch
                and torch.equal(torch.get_rng_state(), follows[2])
            ):
                torch.set_rng_state(follows[1])
            self._record(epoch, {**self.capture(source), **fields})

    def _record(self, epoch: int, captured: dict[str, Any]) -> None:
        """Keep what ``epoch``'s order was drawn from, and the records of the epochs before it.

        A state saved in an earlier epoch may still ask for them once this epoch was opened
        ahead (short epochs: several); those of later epochs, from an earlier pass, no longer
        hold. A new dict each time, so that a reader in another thread sees one whole version.
        """
        kept = {e: c for e, c in self.captures.items() if epoch - KEPT_EPOCHS < e < epoch}
        self.captures = {**kept, epoch: captured}

    def capture(self, source: object) -> dict[str, Any]:
        """What an order of ``source`` drawn now is drawn from: the generators, its epoch."""
        captured: dict[str, Any] = {
            "rng": capture_rng(source),
            "sampler_epoch": sampler_epoch_of(source),
            # A persistent loader's first iterator also draws its workers' base seed (that of
            # the loader a wrapper iterates, too).
            "fresh_iterator": live_iterator(iterated_loader(source)) is None,
        }
        if self.count is not None:
            captured.update(self.count.drawn(captured["sampler_epoch"]))
        return captured

    def restore(self, source: object, states: dict[str, torch.Tensor]) -> None:
        """Set the generators to ``states`` (torch's global one and ``source``'s own)."""
        generators = generators_of(source)
        for name, state in states.items():
            if name == "torch":
                torch.set_rng_state(state)
            elif name in generators:
                generators[name].set_state(state)
