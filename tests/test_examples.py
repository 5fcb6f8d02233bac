"""The examples stay runnable."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from nostall._doctor import load_callable

ROOT = Path(__file__).resolve().parent.parent


def test_slow_loader_example_builds_and_steps() -> None:
    """The doctor's example: its factory takes the overrides, its step trains on a batch."""
    make_loader = load_callable("examples.slow_loader:make_loader", "factory")
    train_step = load_callable("examples.slow_loader:train_step", "--step")
    loader = make_loader(num_workers=0, pin_memory=False)
    images, labels = next(iter(loader))
    assert (32, 3, 32, 32) == tuple(images.shape)
    assert math.isfinite(train_step((images, labels)))


def run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def test_gil_threads_shows_native_code_overlapping_python() -> None:
    """A torch product in one thread overlaps a pure-Python loop in another."""
    done = run(["examples/gil_threads.py", "--loop", "3000000", "--size", "600", "--products", "6"])
    assert 0 == done.returncode, done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("python loop + torch"))
    both = float(line.split(": ")[1].split(" s")[0])
    total = float(line.split("(sum ")[1].split(" s")[0])
    assert both < 0.9 * total, line


def test_hogwild_trains_the_shared_model() -> None:
    """Two processes updating one shared model make it accurate."""
    done = run(["examples/hogwild.py", "--processes", "2", "--steps", "150"])
    assert 0 == done.returncode, done.stderr
    after = float(done.stdout.strip().splitlines()[-1].rsplit(" ", 1)[1])
    assert after > 0.85, done.stdout


def test_ddp_train_under_torchrun() -> None:
    """DDP + DistributedSampler + nostall.prefetch under torchrun, gloo on the CPU."""
    done = run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/ddp_train.py",
            "--epochs",
            "2",
            "--samples",
            "512",
        ]
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} epoch 1: mean loss" in done.stdout
    assert "slowest rank:" in done.stdout
