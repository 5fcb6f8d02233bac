"""A short side-by-side demo: a slow loader and a slow step, serial vs through ``nostall.prefetch``.

Loading sleeps (I/O-like latency, which releases the GIL as real reads do) and the step runs
matrix products (native code, which releases the GIL too). Run serially, an epoch costs
load + step per batch; with the loading done in a thread it should cost close to
max(load, step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ._device import DeviceLike, resolve_device
from ._prefetcher import prefetch
from ._transfer import to_device


class SlowBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A map-style dataset whose items are whole batches that take ``load_s`` each to load."""

    def __init__(self, batches: int, batch_size: int, load_s: float) -> None:
        self.batches, self.batch_size, self.load_s = batches, batch_size, load_s

    def __len__(self) -> int:
        return self.batches

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.load_s)
        images = torch.full((self.batch_size, 3, 32, 32), index % 256, dtype=torch.uint8)
        labels = torch.full((self.batch_size,), index, dtype=torch.int64)
        return images, labels


def make_step(step_s: float, device: torch.device) -> Callable[[Any], int]:
    """Return a training-step stand-in that computes for about ``step_s`` seconds on ``device``.

    The number of matrix products is calibrated here, once, so that the step does real work
    rather than sleeping.
    """
    weight = torch.randn(384, 384, device=device)

    def products(n: int, images: torch.Tensor) -> torch.Tensor:
        x = images.float().flatten(1)[:, :384] / 255.0
        for _ in range(n):
            x = torch.tanh(x @ weight)
        return x

    sample = torch.zeros(32, 3, 32, 32, dtype=torch.uint8, device=device)
    _synchronize(device)
    products(20, sample)  # warm-up: thread pools start, caches fill
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        products(50, sample)
        _synchronize(device)
        rounds.append((time.perf_counter() - start) / 50)
    per_product = min(rounds)  # the steady state, not a round that was interrupted
    count = max(1, round(step_s / per_product))

    def step(batch: Any) -> int:
        """Compute on the batch; return its label, which names the batch."""
        images, labels = batch
        products(count, images).sum().item()  # .item() waits for the GPU, as a real loss would
        return int(labels[0].item())

    return step


@dataclass
class DemoResult:
    """Timings of one demo run, in seconds; ``epochs`` holds every repeat of each way."""

    batches: int
    load_s: float
    step_s: float
    device: str
    epochs: dict[str, list[float]] = field(default_factory=dict)

    def median(self, way: str) -> float:
        """The median epoch time of one way of loading."""
        return statistics.median(self.epochs[way])


def run_demo(
    *,
    batches: int = 40,
    load_ms: float = 25.0,
    step_ms: float = 25.0,
    batch_size: int = 32,
    depth: int = 2,
    repeats: int = 3,
    device: DeviceLike = None,
) -> DemoResult:
    """Time the serial loop and the ``nostall.prefetch`` loop, alternating, ``repeats`` times each.

    Raises:
        RuntimeError: the two loops did not see the same batches (they always should).
    """
    dev = resolve_device(device)
    loader = DataLoader(SlowBatches(batches, batch_size, load_ms / 1000), batch_size=None)
    step = make_step(step_ms / 1000, dev)
    result = DemoResult(batches, load_ms / 1000, step_ms / 1000, str(dev))

    def serial() -> list[int]:
        return [step(to_device(batch, dev)) for batch in loader]

    def prefetched() -> list[int]:
        return [step(batch) for batch in prefetch(loader, dev, depth=depth)]

    first = to_device(next(iter(loader)), dev)

    def load_only() -> list[int]:
        return [int(labels[0]) for _, labels in loader]

    def step_only() -> list[int]:
        return [step(first) for _ in range(batches)]

    # The two parts alone, measured in the same run: the ideal overlapped epoch is the longer.
    ways = {
        "load only": load_only,
        "step only": step_only,
        "serial DataLoader": serial,
        "nostall.prefetch": prefetched,
    }
    seen: dict[str, list[int]] = {}
    for _ in range(repeats):
        for name, loop in ways.items():
            start = time.perf_counter()
            seen[name] = loop()
            result.epochs.setdefault(name, []).append(time.perf_counter() - start)
    if seen["serial DataLoader"] != seen["nostall.prefetch"]:
        raise RuntimeError("the prefetched loop saw different batches from the serial loop")
    return result


def format_demo(result: DemoResult) -> str:
    """Render a :class:`DemoResult` as a small table with a plain verdict."""
    serial = result.median("serial DataLoader")
    load, step = result.median("load only"), result.median("step only")
    ideal = max(load, step)
    lines = [
        f"nostall demo: {result.batches} batches on {result.device}; loading "
        f"{result.load_s * 1e3:.0f} ms/batch (sleep, releases the GIL), step "
        f"{result.step_s * 1e3:.0f} ms/batch (matrix products); median of "
        f"{len(result.epochs['serial DataLoader'])} alternating runs",
        "",
        f"  {'way':<20} {'epoch (s)':>10} {'per batch (ms)':>15} {'speed-up':>9}",
    ]
    for way in ("serial DataLoader", "nostall.prefetch"):
        epoch = result.median(way)
        lines.append(
            f"  {way:<20} {epoch:>10.3f} {epoch / result.batches * 1e3:>15.1f} "
            f"{serial / epoch:>8.2f}x"
        )
    best = result.median("nostall.prefetch")
    lines += [
        "",
        f"  measured alone: loading {load:.3f} s, step {step:.3f} s per epoch; ideal overlap "
        f"max(load, step) = {ideal:.3f} s, serial sum = {load + step:.3f} s",
        f"  nostall.prefetch took {best / serial:.0%} of the serial time "
        f"({best / ideal:.2f}x the ideal overlap).",
    ]
    return "\n".join(lines)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
