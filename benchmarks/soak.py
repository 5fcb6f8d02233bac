"""A short soak: nostall's lifecycles over and over, checking that nothing grows or is lost.

Each round runs the ways a training script uses a prefetcher: a full epoch (plain, with
``threads=2``, across epochs with ``set_epoch``), a ``break`` mid-epoch, an error in one batch
caught by the loop, ``close()`` mid-epoch, and a mid-epoch ``state_dict`` resumed by a new
prefetcher; then the same over a stream (an ``IterableDataset``) read by ``threads=2``.
Every epoch is checked against the plain loader (every batch once, in order; for the stream,
the batches of ``num_workers=2``).
The process's resident memory, threads and open files are sampled after each round; the
soak fails when, after a warm-up, they grow beyond generous bounds (a leak grows without end;
the allocator's noise does not).

    python benchmarks/soak.py --seconds 60 [--json out/soak.json]

Exit status 0 when flat and exact, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import nostall

#: Growth allowed after the warm-up rounds (a leak of one batch per round exceeds these).
RSS_GROWTH_MB = 64.0
THREAD_GROWTH = 2
FD_GROWTH = 4
WARMUP_ROUNDS = 3


class Samples(Dataset[torch.Tensor]):
    """Sample i is a small tensor holding i; sample ``fail_at`` raises once per epoch."""

    def __init__(self, n: int = 96, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is bad")
        return torch.full((64,), float(i))


def loader(**kwargs: Any) -> DataLoader[torch.Tensor]:
    """The plain loader each step wraps: 12 batches of 8."""
    return DataLoader(Samples(**kwargs), batch_size=8)


def firsts(batches: Any) -> list[int]:
    """Each batch's first sample: the batch's identity, for order checks."""
    return [int(b[0, 0]) for b in batches]


EXPECTED = list(range(0, 96, 8))


def full_epochs() -> None:
    """Two whole epochs, plain and with threads=2, each equal to the loader's."""
    for threads in (None, 2):
        with nostall.prefetch(loader(), threads=threads) as p:
            for _ in range(2):
                assert EXPECTED == firsts(p), f"threads={threads}"


def across_epochs() -> None:
    """Three epochs run ahead across their boundaries, set_epoch before each."""
    # Its own generator: the base seed an epoch opened ahead draws is then not the loop's.
    seeded = DataLoader(Samples(), batch_size=8, generator=torch.Generator().manual_seed(0))
    with nostall.prefetch(seeded, across_epochs=True) as p:
        for epoch in range(3):
            p.set_epoch(epoch)
            assert EXPECTED == firsts(p)


def break_mid_epoch() -> None:
    """A loop that breaks, then drops the prefetcher."""
    p = nostall.prefetch(loader(), threads=2)
    for i, _ in enumerate(p):
        if i == 3:
            break
    del p


def caught(batches: Any) -> list[int | str]:
    """Each batch's first sample, or "error" for a batch that raised a ValueError, caught."""
    got: list[int | str] = []
    it = iter(batches)
    while True:
        try:
            got.append(int(next(it)[0, 0]))
        except StopIteration:
            return got
        except ValueError:
            got.append("error")


def error_in_one_batch() -> None:
    """One batch raises; the loop catches it and gets every other batch."""
    got = caught(nostall.prefetch(loader(fail_at=20)))
    assert [0, 8, "error", *EXPECTED[3:]] == got, got


def close_mid_epoch() -> None:
    """close() with batches in flight."""
    p = nostall.prefetch(loader())
    it = iter(p)
    next(it)
    p.close()


def resume_mid_epoch() -> None:
    """A state saved after 5 batches, resumed by a new prefetcher: the rest, exactly."""
    p = nostall.prefetch(loader())
    it = iter(p)
    seen = [int(next(it)[0, 0]) for _ in range(5)]
    state = p.state_dict()
    p.close()
    q = nostall.prefetch(loader())
    q.load_state_dict(state)
    assert EXPECTED == seen + firsts(q)
    q.close()


class Stream(IterableDataset[torch.Tensor]):
    """Items 0 to 47; worker w of k reads every k-th from w; item ``fail_at`` raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, 48, workers):
            if i == self.fail_at:
                raise ValueError(f"item {i} is bad")  # ends this worker's items
            yield torch.full((64,), float(i))


#: The first items of a stream's batches of 4 with 2 workers (theirs in turn), as a
#: DataLoader with num_workers=2 gives them.
STREAM = [0, 1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41]


def stream_with_threads() -> None:
    """A stream read by 2 threads: epochs, a break, an error caught, a resume mid-epoch."""
    with nostall.prefetch(DataLoader(Stream(), batch_size=4), threads=2) as p:
        assert STREAM == firsts(p)
        for i, _ in enumerate(p):
            if i == 3:
                break
        assert STREAM == firsts(p)
        it = iter(p)
        seen = [int(next(it)[0, 0]) for _ in range(5)]
        state = p.state_dict()
    with nostall.prefetch(DataLoader(Stream(), batch_size=4), threads=2) as q:
        q.load_state_dict(state)
        assert STREAM == seen + firsts(q)
    got = caught(nostall.prefetch(DataLoader(Stream(fail_at=17), batch_size=4), threads=2))
    assert [0, 1, 8, 9, 16, "error", 24, 32, 40] == got, got  # worker 1's items end there


ROUND: list[Callable[[], None]] = [
    full_epochs,
    across_epochs,
    break_mid_epoch,
    error_in_one_batch,
    close_mid_epoch,
    resume_mid_epoch,
    stream_with_threads,
]


def settled_threads(deadline_s: float = 5.0) -> int:
    """The thread count once nostall's threads have ended (they end shortly after use)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not any(t.name.startswith("nostall-") for t in threading.enumerate()):
            break
        time.sleep(0.05)
    return threading.active_count()


def soak(seconds: float) -> dict[str, Any]:
    """Run rounds for ``seconds`` (at least the warm-up and one more); what grew."""
    me = psutil.Process(os.getpid())
    rows: list[dict[str, float]] = []
    start = time.monotonic()
    rounds = 0
    while time.monotonic() - start < seconds or rounds <= WARMUP_ROUNDS:
        for step in ROUND:
            step()
        rounds += 1
        rows.append(
            {
                "round": rounds,
                "seconds": round(time.monotonic() - start, 1),
                "rss_mb": me.memory_info().rss / 2**20,
                "threads": settled_threads(),
                "fds": me.num_fds() if hasattr(me, "num_fds") else 0,
            }
        )
    base, rest = rows[WARMUP_ROUNDS - 1], rows[WARMUP_ROUNDS:]
    growth = {
        "rss_mb": max(r["rss_mb"] for r in rest) - base["rss_mb"],
        "threads": max(r["threads"] for r in rest) - base["threads"],
        "fds": max(r["fds"] for r in rest) - base["fds"],
    }
    flat = (
        growth["rss_mb"] <= RSS_GROWTH_MB
        and growth["threads"] <= THREAD_GROWTH
        and growth["fds"] <= FD_GROWTH
    )
    return {"rounds": rounds, "flat": flat, "growth": growth, "base": base, "last": rows[-1]}


def main(argv: list[str] | None = None) -> int:
    """The command line: soak, print one line, exit 0 when flat."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to soak")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)
    result = soak(args.seconds)
    growth = result["growth"]
    print(
        f"{result['rounds']} rounds in {result['last']['seconds']} s; growth after warm-up: "
        f"RSS {growth['rss_mb']:+.1f} MiB, threads {growth['threads']:+d}, "
        f"open files {growth['fds']:+d}: {'flat' if result['flat'] else 'GROWING'}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
