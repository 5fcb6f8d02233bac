"""Why a prefetch thread helps despite the GIL: native code releases it.

    python examples/gil_threads.py

A pure-Python loop holds the GIL; a matrix product in NumPy or PyTorch releases it while it
computes. Run one of each in two threads and they overlap: the pair takes about as long as the
longer one, not the sum. Two pure-Python loops do not overlap. (Seed 000's experiment, timed.)
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

# One core for the native work and one for Python: NumPy's BLAS reads this when it is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np
import torch


def python_loop(n: int) -> int:
    """Pure Python: holds the GIL throughout."""
    total = 0
    for i in range(n):
        total += i
    return total


def timed(fn: Callable[[], None], runs: int = 2) -> float:
    """Seconds one call takes (the fastest of ``runs``: the first pays for warm-up)."""
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def together(first: Callable[[], None], second: Callable[[], None], runs: int = 2) -> float:
    """Seconds for both, each in its own thread (the fastest of ``runs``)."""
    best = float("inf")
    for _ in range(runs):
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    """Time each alone and in pairs; print the overlap."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--loop", type=int, default=20_000_000, help="pure-Python iterations")
    parser.add_argument("--size", type=int, default=1500, help="matrix size")
    parser.add_argument("--products", type=int, default=6, help="matrix products")
    args = parser.parse_args()
    torch.set_num_threads(1)
    a = np.random.default_rng(0).standard_normal((args.size, args.size))
    t = torch.from_numpy(a)

    def loop() -> None:
        python_loop(args.loop)

    def numpy_products() -> None:
        for _ in range(args.products):
            a @ a

    def torch_products() -> None:
        for _ in range(args.products):
            t @ t

    alone = {
        "python loop": timed(loop),
        "numpy products": timed(numpy_products),
        "torch products": timed(torch_products),
    }
    for name, seconds in alone.items():
        print(f"{name:<16} alone: {seconds:.3f} s")
    for native, name in ((numpy_products, "numpy products"), (torch_products, "torch products")):
        both = together(loop, native)
        total = alone["python loop"] + alone[name]
        print(
            f"python loop + {name} in two threads: {both:.3f} s "
            f"(sum {total:.3f} s, longer alone {max(alone['python loop'], alone[name]):.3f} s)"
        )
    both = together(loop, loop)
    print(
        f"two python loops in two threads: {both:.3f} s (sum {2 * alone['python loop']:.3f} s)"
        f": the GIL lets only one run at a time"
    )


if __name__ == "__main__":
    main()
