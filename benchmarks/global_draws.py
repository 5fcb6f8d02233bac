"""What watching a source for draws from the global random generators costs.

nostall judges one pull per prefetcher (an epoch's second batch) by comparing the global
generators' states around it (``nostall._sources.global_draws``); until then, and for good if the
source draws, it pulls in step with the loop. This prints, each as a median with its spread:

* ``snapshot``: one reading of every global generator, and of each alone (torch's CPU
  generator is a 5,056-byte state; Python's ``random.getstate()`` builds 625 ints; NumPy's
  ``get_state()`` copies 624 words); a judged pull takes two and compares them;
* ``hand-off``: microseconds per batch through ``nostall.prefetch`` of a source that costs
  nothing and draws nothing (an iterable class, so that it is watched), after the judged
  batch: what the watch leaves on every batch once clear. Run it against another checkout to
  compare (``PYTHONPATH=/tmp/before/src python benchmarks/global_draws.py --only-handoff``);
* ``in step``: microseconds per batch for a source that draws (pulled in step for good),
  against the plain loop over the same source;
* ``first batches``: a loop of 5 ms steps over a source loading a batch in 5 ms, watched
  against unwatched: the time to the end of 20 batches (the cost is about one batch's load).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import torch

import nostall


def spread(values: list[float], unit: str) -> str:
    """A median with its range."""
    return (
        f"median {statistics.median(values):.2f} {unit} (min {min(values):.2f}, "
        f"max {max(values):.2f}, {len(values)} runs)"
    )


def per_call_us(fn: Callable[[], object], runs: int) -> list[float]:
    """Microseconds per call of ``fn``, one figure per run of ~0.1 s."""
    from torch.utils.benchmark import Timer

    timer = Timer("fn()", globals={"fn": fn})
    return [timer.timeit(number=2000).mean * 1e6 for _ in range(runs)]


class Batches:
    """A re-iterable source of ready tensors (not a list: a list is never watched)."""

    def __init__(self, n: int, draw: bool = False) -> None:
        self.items = [torch.tensor([i]) for i in range(n)]
        self.draw = draw

    def __iter__(self) -> Iterator[torch.Tensor]:
        for item in self.items:
            if self.draw:
                torch.rand(())
            yield item


def handoff_us(source: Batches) -> float:
    """Microseconds per batch through nostall.prefetch, after the first two batches."""
    p = nostall.prefetch(source, "cpu")
    it = iter(p)
    next(it), next(it)  # the first batch, and the judged one
    start = time.perf_counter()
    count = sum(1 for _ in it)
    elapsed = time.perf_counter() - start
    p.close()
    return elapsed / count * 1e6


def plain_us(source: Batches) -> float:
    """Microseconds per batch of the plain loop over ``source``."""
    start = time.perf_counter()
    count = sum(1 for _ in source)
    return (time.perf_counter() - start) / count * 1e6


class Slow:
    """20 batches, each loaded in ``load_s`` (a sleep: it releases the GIL, as I/O does)."""

    def __init__(self, load_s: float) -> None:
        self.load_s = load_s

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(20):
            time.sleep(self.load_s)
            yield torch.tensor([i])


def loop_s(watched: bool, load_s: float = 0.005, step_s: float = 0.005) -> float:
    """Seconds for a prefetched loop over :class:`Slow`, its source watched or not."""
    from nostall._sources.global_draws import unwatched

    start = time.perf_counter()
    if watched:
        p = nostall.prefetch(Slow(load_s), "cpu")
    else:
        with unwatched():
            p = nostall.prefetch(Slow(load_s), "cpu")
    for _ in p:
        time.sleep(step_s)
    return time.perf_counter() - start


def main() -> None:
    """Print each figure with its spread."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--only-handoff", action="store_true")
    args = parser.parse_args()
    runs = args.runs
    clear = Batches(args.batches)
    print(f"hand-off, clear source: {spread([handoff_us(clear) for _ in range(runs)], 'us/batch')}")
    if args.only_handoff:
        return
    import numpy as np

    from nostall._sources.generators import moved, snapshot

    np.random.rand()
    first = snapshot()
    print(f"snapshot, all generators: {spread(per_call_us(snapshot, runs), 'us')}")
    print(f"  moved(a, b): {spread(per_call_us(lambda: moved(first, first), runs), 'us')}")
    print(
        f"  torch get_state: {spread(per_call_us(torch.default_generator.get_state, runs), 'us')}"
    )
    print(f"  random.getstate: {spread(per_call_us(random.getstate, runs), 'us')}")
    print(f"  np.random.get_state: {spread(per_call_us(np.random.get_state, runs), 'us')}")
    judged = [
        2 * a + b
        for a, b in zip(
            per_call_us(snapshot, runs), per_call_us(lambda: moved(first, first), runs), strict=True
        )
    ]
    print(f"one judged pull (2 snapshots + compare): {spread(judged, 'us')}")
    drawing = Batches(args.batches, draw=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = [handoff_us(drawing) for _ in range(runs)]
    print(f"in step, drawing source: {spread(step, 'us/batch')}")
    print(
        f"plain loop, same source: {spread([plain_us(drawing) for _ in range(runs)], 'us/batch')}"
    )
    watched = [loop_s(True) * 1e3 for _ in range(runs)]
    unwatched = [loop_s(False) * 1e3 for _ in range(runs)]
    print(f"first batches, 20 x (5 ms load, 5 ms step), watched: {spread(watched, 'ms')}")
    print(f"                                           unwatched: {spread(unwatched, 'ms')}")
    print(f"(python {sys.version.split()[0]}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
