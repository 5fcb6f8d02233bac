"""The process's global random generators: where they are, whether they moved, and back.

torch's CPU generator, torch.cuda's (once CUDA is initialised), Python's ``random`` and NumPy's
``np.random`` (once NumPy is imported) are each one stream shared by every thread of the
process. :func:`snapshot` and :func:`moved` tell whether anything drew between two moments;
:class:`Saved` puts them back. What a prefetcher does with that is
:mod:`nostall._sources.global_draws`'s.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

#: The generators, as messages name them.
TORCH, CUDA, PYTHON, NUMPY = (
    "torch's global generator",
    "torch.cuda's generator",
    "Python's random",
    "NumPy's np.random",
)


class Snapshot(NamedTuple):
    """Where each global generator is; equal snapshots mean nothing was drawn between them."""

    torch: torch.Tensor
    cuda: tuple[int, ...]
    python: Any
    numpy: Any


def snapshot() -> Snapshot:
    """The global generators' positions now (NumPy's only once NumPy is imported).

    torch.cuda's generators are read only once CUDA is initialised (reading them must not
    initialise it): their Philox offset, which every draw advances.
    """
    numpy: Any = sys.modules.get("numpy")
    cuda: tuple[int, ...] = ()
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        cuda = tuple(g.get_offset() for g in torch.cuda.default_generators)
    legacy = None
    if numpy is not None:
        _, keys, position, *_ = numpy.random.get_state()
        legacy = (position, keys.tobytes())
    return Snapshot(torch.default_generator.get_state(), cuda, random.getstate(), legacy)


def moved(before: Snapshot, after: Snapshot) -> tuple[str, ...]:
    """The generators (as :data:`TORCH` ... name them) drawn from between two snapshots."""
    drawn = []
    if not torch.equal(before.torch, after.torch):
        drawn.append(TORCH)
    if before.cuda != after.cuda:
        drawn.append(CUDA)
    if before.python != after.python:
        drawn.append(PYTHON)
    if before.numpy is not None and after.numpy is not None and before.numpy != after.numpy:
        drawn.append(NUMPY)
    return tuple(drawn)


class Saved:
    """The global generators' whole states at a moment (made), to set them back to.

    Invariant: :meth:`put_back` leaves each generator as it was when this was made (torch.cuda's
    where a fresh one starts, if CUDA started since), whatever was drawn in between.
    """

    def __init__(self) -> None:
        self.before = snapshot()
        numpy: Any = sys.modules.get("numpy")
        # Whole states to put back (the snapshot holds only what tells a draw).
        self.numpy = None if numpy is None else numpy.random.get_state()
        self.cuda = tuple(g.get_state() for g in _cuda_generators())

    def put_back(self) -> None:
        """Set every global generator back to its state when this was made."""
        torch.default_generator.set_state(self.before.torch)
        random.setstate(self.before.python)
        numpy: Any = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)
        generators = _cuda_generators()
        if self.cuda:
            for generator, state in zip(generators, self.cuda, strict=True):
                generator.set_state(state)
        else:  # CUDA started since: where a fresh generator starts
            for generator in generators:
                generator.set_offset(0)


class HandBack(Saved):
    """The user's generators, saved to be given back once (calling it) after nostall drew.

    Invariant: after the first call every global generator is as when this was made, and
    ``drew`` says whether torch's had moved from ``since`` by then; later calls do nothing.
    """

    def __init__(self, since: torch.Tensor) -> None:
        super().__init__()
        self.since, self.done, self.drew = since, False, False

    def __call__(self) -> None:
        if not self.done:
            self.done, self.drew = True, not torch.equal(torch.get_rng_state(), self.since)
            self.put_back()


#: The last call seen drawing past a sample's own generators in a loading thread: (a count of
#: such calls noted in the process, what was called and where), for the warning to name.
_escape: list[tuple[int, str]] = [(0, "")]
_escape_lock = threading.Lock()


def note_escape(call: str) -> None:
    """A loading thread's sample made ``call`` (what, and where), which draws past its routing."""
    with _escape_lock:
        _escape[0] = (_escape[0][0] + 1, call)


def escapes_noted() -> int:
    """How many escaping calls were noted so far (to tell later ones by)."""
    return _escape[0][0]


def escape_since(count: int) -> str:
    """The last escaping call noted after the ``count``-th (empty: none since)."""
    noted, call = _escape[0]
    return call if noted > count else ""


class Trial:
    """A batch's samples, fetched in parallel if its first one, judged alone, drew nothing.

    Invariants:
        * Made (the global generators' positions read) in the pulling thread, after the
          sampler drew the batch's indices and before any of its samples starts; judged
          (:meth:`judge`) once the batch's first sample returned, fetched alone in that
          thread while the loop waits for its batch (the pull is in step): a generator that
          moved was moved by that sample (or by another thread: see the module).
        * Nothing is put back. The judged sample drew where the plain loop draws; judged as
          drawing, the watch is told (``on_draws``) and the batch's other samples are fetched
          after it, one at a time, in order, in the pulling thread; judged clear, the loading
          threads fetch them. Another thread's draws are never drawn a second time.
        * Judged once; later calls give the same answer.
    """

    def __init__(
        self,
        on_draws: Callable[[tuple[str, ...]], None],
        on_clear: Callable[[], None] = lambda: None,
    ) -> None:
        self.before = snapshot()
        self.on_draws, self.on_clear = on_draws, on_clear
        self.drew: tuple[str, ...] | None = None  # None: not judged yet

    def judge(self) -> tuple[str, ...]:
        """The generators the first sample drew from (none: it drew nothing).

        Judged clear, ``on_clear()`` is called: the threads load the batch's other samples.
        """
        if self.drew is None:
            self.drew = moved(self.before, snapshot())
            if self.drew:
                self.on_draws(self.drew)
            else:
                self.on_clear()
        return self.drew


#: The generators whose whole states :func:`states_of` reads, by the names messages use.
STATE_KEYS = {TORCH: "torch", PYTHON: "random", NUMPY: "numpy"}


def states_of(names: tuple[str, ...], now: Snapshot | None = None) -> dict[str, Any] | None:
    """The whole states of the generators ``names`` (as :data:`TORCH` ... name them), to save.

    Plain types and tensors only (a checkpoint may be loaded with ``weights_only=True``):
    NumPy's keys as an int64 tensor. ``now``: a snapshot just taken (its torch and Python
    states are whole). None where one of them cannot be saved (torch.cuda's).
    """
    if any(name not in STATE_KEYS for name in names):
        return None
    now = now or snapshot()
    states: dict[str, Any] = {}
    for name in names:
        if name == TORCH:
            states["torch"] = now.torch
        elif name == PYTHON:
            states["random"] = now.python
        else:
            numpy: Any = sys.modules.get("numpy")
            kind, keys, position, has_gauss, gauss = numpy.random.get_state()
            keys = torch.from_numpy(keys.astype(numpy.int64))
            states["numpy"] = (kind, keys, int(position), int(has_gauss), float(gauss))
    return states


def set_states(states: dict[str, Any]) -> None:
    """Set the generators :func:`states_of` saved to those states."""
    for key, state in states.items():
        if key == "torch":
            torch.set_rng_state(state)
        elif key == "random":
            random.setstate(as_tuples(state))
        elif key == "numpy":
            import numpy as np

            kind, keys, position, has_gauss, gauss = state
            keys = np.asarray(keys.numpy(), dtype=np.uint32)
            np.random.set_state((kind, keys, position, has_gauss, gauss))


def as_tuples(state: Any) -> Any:
    """Python's ``random`` state with its lists made tuples again (a checkpoint may list them)."""
    if isinstance(state, list):
        return tuple(as_tuples(item) for item in state)
    return state


def _cuda_generators() -> tuple[torch.Generator, ...]:
    """torch.cuda's default generators, once CUDA is initialised (reading must not init it)."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return ()
    return tuple(torch.cuda.default_generators)
