"""Shared fixtures: every test must leave no nostall thread running."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from helpers import wait_for_no_nostall_threads


@pytest.fixture(scope="module", autouse=True)
def _heap_unfrozen_after_each_file() -> Iterator[None]:
    """After a test file, the heap its tests froze (below) is collected again as a whole."""
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _no_thread_left_behind() -> Iterator[None]:
    # A full collection walks every tracked object: with torch, the frameworks and the test
    # modules imported, that took most of a second, as long as the test itself. What is alive
    # when the test starts (after collecting what the last one dropped) is frozen, so the
    # collection after it walks only what the test made, and collects every cycle among that,
    # its prefetchers' included. The file's end unfreezes it all for a full collection.
    gc.collect()
    gc.freeze()
    yield
    gc.collect()
    alive = wait_for_no_nostall_threads(timeout=5.0)
    assert not alive, f"nostall threads still running after the test: {alive}"


#: The test files that take longest, longest first (most start processes: torchrun, DDP, the
#: benchmark scripts, interpreter exits), as measured on the 2-core machine. They are collected
#: first, and `make test` has xdist hand the files out in that order (--no-loadscope-reorder;
#: by default it orders them by their number of tests), so that the short files fill in at the
#: end instead of one worker running a long file alone while the other has nothing left.
SLOWEST_FIRST = (
    "test_exit.py",
    "test_benchmark_scripts.py",
    "test_lightning.py",
    "test_epochs.py",
    "test_torchrun.py",
    "test_fabric.py",
    "test_ray.py",
    "test_accelerate.py",
    "test_prefetcher.py",
    "test_examples.py",
    "test_transformers.py",
    "test_doctor.py",
    "test_threads.py",
    "test_streaming.py",
    "test_cli.py",
    "test_threaded_stream.py",
    "test_thread_safety.py",
    "test_profile.py",
    "test_tune.py",
    "test_warn.py",
    "test_sharding.py",
    "test_bench_trials.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's order kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fast_worker_shutdown(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Shorten PyTorch's worker status interval while the test's loaders are collected.

    After a worker error, a DataLoader's shutdown waits that long per worker (5 s by default),
    with or without nostall.
    """
    import torch.utils.data._utils as data_utils

    monkeypatch.setattr(data_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)
    yield
    gc.collect()  # while the short interval is still in place
