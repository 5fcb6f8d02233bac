"""Whether a DataLoader's samples come out the same when threads load them at once.

``threads=`` calls the dataset's ``__getitem__`` from several threads at a time. A dataset
that is not safe for that (one file object shared by a seek and a read, a decoder handle,
a cache filled without a lock) gives wrong samples without any error. ``tune`` and the doctor
must not recommend threads for it, so before trying threads they run this check:

1. the first samples of the dataset are loaded with ``threads=1`` (its own random state per
   sample, as ``threads=`` gives), and the global generators (torch's, Python's ``random``,
   NumPy's) are watched: a dataset that draws from them cannot be checked, since threads
   share them and interleave their draws (``random``);
2. the same samples are loaded twice with ``threads=N`` (the global generators put back first);
   any sample that differs from the one-thread load says the dataset is not thread-safe
   (``differed``); if all agree, nothing was seen (``agreed``).

A race that did not happen in these loads is not seen: ``agreed`` is evidence, not proof.
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from ._prefetcher import prefetch
from ._torch_compat import auto_collation

#: The most samples the check loads per pass (three passes; two kept at a time).
MAX_SAMPLES = 64

Verdict = Literal["agreed", "differed", "random", "failed"]


@dataclass(frozen=True)
class ThreadSafety:
    """The outcome of :func:`check_thread_safety` for ``threads`` threads over ``samples``."""

    verdict: Verdict
    threads: int
    samples: int
    #: For "differed": the first and last sample index of the first sample (or collated batch)
    #: that differed from the one-thread load.
    differed: tuple[int, int] | None = None
    #: Why the check could not decide ("random", "failed").
    why: str = ""

    @property
    def unsafe(self) -> bool:
        """Whether threads gave other samples than one thread: never recommend threads."""
        return self.verdict == "differed"

    def describe(self) -> str:
        """One line, as the doctor prints it."""
        n = self.threads
        if self.verdict == "agreed":
            return (
                f"thread safety: {n} threads loaded the same {self.samples} samples as one "
                f"thread, twice (a check, not a proof)."
            )
        if self.differed is not None:
            first, last = self.differed
            which = f"sample {first}" if first == last else f"the batch of samples {first}-{last}"
            return (
                f"thread safety: NOT thread-safe: with {n} threads at once, {which} came out "
                f"other than one thread loaded it, so threads were not tried. Its __getitem__ "
                f"shares something between calls (a file position used by seek then read, a "
                f"decoder, a cache): give each thread its own (os.pread, threading.local()), "
                f"or keep worker processes."
            )
        return f"thread safety: not checked: {self.why}."


def check_thread_safety(loader: DataLoader[Any], threads: int) -> ThreadSafety:
    """Load ``loader``'s first samples with one thread, then twice with ``threads``; compare.

    See the module docstring. The samples are batched and collated as ``loader`` does, at most
    :data:`MAX_SAMPLES` of them in at least two batches. Never raises for the dataset's errors:
    an error makes a "failed" check (the trials show the error itself).
    """
    dataset = loader.dataset
    try:
        count = min(len(dataset), MAX_SAMPLES)  # type: ignore[arg-type]
    except TypeError:
        return ThreadSafety("failed", threads, 0, why="the dataset has no len()")
    batch_size = (loader.batch_size or 8) if auto_collation(loader) else None
    if batch_size is not None:
        batch_size = max(1, min(batch_size, math.ceil(count / 2)))  # two batches at least

    def load(threads: int) -> list[Any]:
        check = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=range(count),
            collate_fn=loader.collate_fn,
            # The samples' random states come from this generator's first draw (the epoch's
            # base seed), the same in every pass, and not from the global generator.
            generator=torch.Generator().manual_seed(0),
        )
        # Deep enough that every thread has a sample to load, one sample per batch too.
        return list(prefetch(check, "cpu", threads=threads, depth=max(2, 2 * threads)))

    try:
        with _global_generators() as moved:
            reference = load(1)
        if moved():
            return ThreadSafety(
                "random",
                threads,
                count,
                why=(
                    "__getitem__ draws from a global random generator (torch's, random's or "
                    "NumPy's), which threads share; draw from torch.thread_safe_generator() "
                    "to make its samples reproducible with threads, and checkable"
                ),
            )
        for _ in range(2):
            with _global_generators():
                loaded = load(threads)
            item = _first_difference(reference, loaded)
            if item is not None:
                size = batch_size or 1
                first = item * size
                where = (first, min(first + size, count) - 1)
                return ThreadSafety("differed", threads, count, differed=where)
    except Exception as e:
        return ThreadSafety("failed", threads, count, why=f"loading raised {type(e).__name__}")
    return ThreadSafety("agreed", threads, count)


@contextmanager
def _global_generators() -> Iterator[Any]:
    """Put the global generators back afterwards; yield a function: did they move meanwhile?"""
    numpy: Any = sys.modules.get("numpy")  # a dataset that uses it imported it already

    def states() -> tuple[Any, ...]:
        legacy = () if numpy is None else tuple(numpy.random.get_state())
        return (torch.get_rng_state(), random.getstate(), *legacy)

    before = states()
    after: list[tuple[Any, ...]] = []

    def moved() -> bool:
        return not _same(list(before), list(after[0]))

    try:
        yield moved
    finally:
        after.append(states())
        torch.set_rng_state(before[0])
        random.setstate(before[1])
        if numpy is not None:
            numpy.random.set_state(before[2:])


def _first_difference(reference: list[Any], loaded: list[Any]) -> int | None:
    """The position of the first item (a sample, or a collated batch) that differs, or None."""
    if len(reference) != len(loaded):
        return min(len(reference), len(loaded))
    for i, (a, b) in enumerate(zip(reference, loaded, strict=True)):
        if not _same(a, b):
            return i
    return None


def _same(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN; a pair that cannot be compared counts as equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    numpy = sys.modules.get("numpy")
    if numpy is not None and (isinstance(a, numpy.ndarray) or isinstance(b, numpy.ndarray)):
        try:
            return bool(numpy.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
        except Exception:
            return bool(numpy.array_equal(a, b))
    try:
        return bool(a == b) or (a != a and b != b)  # NaN
    except Exception:
        return True
