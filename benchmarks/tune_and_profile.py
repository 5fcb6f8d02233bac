"""Measure the profiler's overhead and accuracy, and nostall.tune against a full grid.

Run: .venv/bin/python benchmarks/tune_and_profile.py
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._tools.tune import Setting, measure


class Sleepy(Dataset[torch.Tensor]):
    """Each sample waits 1 ms, as a read from slow storage would."""

    def __len__(self) -> int:
        return 80_000  # 10,000 batches: a long epoch

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.001)
        return torch.full((16,), float(i))


def factory(
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader[torch.Tensor]:
    """The user's loader factory: settings as keyword arguments."""
    return DataLoader(
        Sleepy(),
        batch_size=8,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


def profiler_overhead(steps: int = 2000, step_s: float = 0.002) -> None:
    """A real ~2 ms compute step, with and without the profiler, alternating."""
    weight = torch.randn(256, 256)
    batch = torch.randn(64, 256)
    # Calibrate a real compute step of about step_s.
    start = time.perf_counter()
    for _ in range(50):
        batch @ weight
    reps = max(1, round(step_s / ((time.perf_counter() - start) / 50)))

    def loop(source: object) -> float:
        start = time.perf_counter()
        for b in source:  # type: ignore[attr-defined]
            for _ in range(reps):
                b @ weight
        return time.perf_counter() - start

    items = [batch] * steps
    plain, wrapped = [], []
    for _ in range(5):
        plain.append(loop(items))
        wrapped.append(loop(nostall.profile(items, device="cpu")))
    p, w = sorted(plain)[2], sorted(wrapped)[2]
    print(
        f"profiler overhead: {(w - p) / steps * 1e6:.2f} us per batch on a "
        f"{p / steps * 1e3:.2f} ms step = {(w - p) / p:.2%} (median of 5, alternating)"
    )


def profiler_accuracy(batches: int = 100, stall_s: float = 0.02) -> None:
    """A source that sleeps ``stall_s`` per batch: the measured wait against the injected one."""

    def stalled() -> Iterator[torch.Tensor]:
        for _ in range(batches):
            time.sleep(stall_s)
            yield torch.zeros(1)

    wrapped = nostall.profile(stalled(), device="cpu")
    for _ in wrapped:
        pass
    report = wrapped.report()
    truth = batches * stall_s
    print(
        f"profiler accuracy: measured wait {report.wait_s:.4f} s vs injected {truth:.4f} s "
        f"({(report.wait_s - truth) / batches * 1e6:+.1f} us per batch; "
        f"{(report.wait_s - truth) / truth:+.2%})"
    )


def tune_vs_grid() -> None:
    """Every setting of a small grid, then what tune chooses, re-measured the same way."""
    cpu = torch.device("cpu")
    grid = {}
    for workers in (0, 2):
        for depth in (1, 2, 4, 8):
            grid[Setting(workers, depth)] = measure(
                factory, Setting(workers, depth), cpu, batches=40
            )[0]
    best_setting = max(grid, key=lambda s: grid[s])
    result = nostall.tune(factory, max_batches=300, device="cpu")
    chosen = measure(factory, result.best, cpu, batches=40)[0]
    epoch = len(factory())
    print("grid (samples/s, 40 timed batches each):")
    for setting, rate in grid.items():
        print(f"  {setting.describe():<40} {rate:8.0f}")
    print(
        f"tune chose {result.best.describe()} after {len(result.curve)} trials and "
        f"{result.batches_spent} batches ({result.batches_spent / epoch:.1%} of a "
        f"{epoch:,}-batch epoch); re-measured: {chosen:.0f} samples/s = "
        f"{chosen / grid[best_setting]:.0%} of the grid's best ({best_setting.describe()})"
    )


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    profiler_overhead()
    profiler_accuracy()
    tune_vs_grid()
