"""What the drop-in guarantees cost: the hand-off per batch, and the wait at an epoch boundary.

Run it against two checkouts to compare them, e.g. this one and an older commit::

    python benchmarks/dropin_costs.py
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before/src python benchmarks/dropin_costs.py

Hand-off: 20,000 one-element tensors from a list through ``nostall.prefetch`` (microseconds per
batch, 5 runs). Boundary: a DataLoader with one persistent worker loading a batch in 16 ms
(sleeps, which release the GIL), a 25 ms step, 6 epochs with ``across_epochs=True`` and a plain
``for`` loop; the median wait for a batch inside an epoch and for each epoch's first batch
(3 runs). A seamless boundary waits about as long as a steady step.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils.data import DataLoader, Dataset

import nostall


def handoff_us(n: int = 20_000) -> float:
    """Microseconds per batch for a source that costs nothing."""
    batches = [torch.tensor([i]) for i in range(n)]
    p = nostall.prefetch(batches, "cpu")
    start = time.perf_counter()
    count = sum(1 for _ in p)
    elapsed = time.perf_counter() - start
    p.close()
    return elapsed / count * 1e6


class Slow(Dataset[torch.Tensor]):
    """64 samples, 2 ms each."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.tensor([i])


def boundary_waits_ms(epochs: int = 6, step_s: float = 0.025) -> tuple[float, float]:
    """Median wait (ms) for a batch inside an epoch, and for the first batch of each epoch."""
    loader = DataLoader(Slow(), batch_size=8, num_workers=1, persistent_workers=True)
    p = nostall.prefetch(loader, "cpu", across_epochs=True)
    steady: list[float] = []
    boundary: list[float] = []
    last = time.perf_counter()
    for epoch in range(epochs):
        for i, _ in enumerate(p):
            wait = time.perf_counter() - last
            if i > 0:
                steady.append(wait)
            elif epoch > 0:
                boundary.append(wait)
            time.sleep(step_s)
            last = time.perf_counter()
    p.close()
    return statistics.median(steady) * 1e3, statistics.median(boundary) * 1e3


def main() -> None:
    """Print both figures with their spread."""
    handoff = [handoff_us() for _ in range(5)]
    print(
        f"hand-off us/batch: median {statistics.median(handoff):.2f} "
        f"(min {min(handoff):.2f}, max {max(handoff):.2f})"
    )
    waits = [boundary_waits_ms() for _ in range(3)]
    steady = [w[0] for w in waits]
    boundary = [w[1] for w in waits]
    print(f"steady wait ms: {', '.join(f'{s:.2f}' for s in steady)}")
    print(f"boundary wait ms: {', '.join(f'{b:.2f}' for b in boundary)}")


if __name__ == "__main__":
    main()
