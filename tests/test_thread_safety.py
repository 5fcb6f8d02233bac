"""The check tune and the doctor make before trying threads (``nostall._tools.thread_safety``)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import SqliteRows
from torch.utils.data import DataLoader, Dataset

import nostall
from nostall._tools.thread_safety import MAX_PASSES, MAX_SAMPLES, MIN_PASSES, check_thread_safety


class Squares(Dataset[torch.Tensor]):
    """Deterministic and stateless: safe for threads."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i], dtype=torch.float32)


class SharedPosition(Dataset[torch.Tensor]):
    """Not thread-safe, like a file object shared by a seek and a read.

    Each call sets the shared position, then reads it back. With several loading threads, calls
    meet in pairs at a barrier between the two (so the race happens on any machine): the earlier
    call of a pair reads the later one's position. One thread never waits.
    """

    def __init__(self) -> None:
        self.position = 0
        self.barrier = threading.Barrier(2)

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        self.position = i  # seek
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            try:
                self.barrier.wait(timeout=2)
            except threading.BrokenBarrierError:
                self.barrier.reset()  # no partner came: go on alone
        return torch.tensor([self.position])  # read


class GlobalNoise(Dataset[torch.Tensor]):
    """Draws from torch's global generator, as a random augmentation does."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i


class HeldGlobalNoise(GlobalNoise):
    """Draws from torch's global generator itself, which threads share (nostall cannot route)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2, generator=torch.default_generator) + i


class OwnNoise(Dataset[torch.Tensor]):
    """Draws from the sample's own generator, as ``generator()`` finds it: one per sample."""

    def __init__(self, generator: Callable[[], torch.Generator | None]) -> None:
        self.generator = generator

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2, generator=self.generator()) + i


def _worker_rng() -> torch.Generator | None:
    info = torch.utils.data.get_worker_info()
    if info is None:
        return None
    assert info.rng is not None  # torch gives every worker its own
    return info.rng.torch_generator


def _thread_safe_generator() -> torch.Generator | None:
    return torch.thread_safe_generator()


class Fails(Squares):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            raise KeyError(i)
        return super().__getitem__(i)


def test_a_stateless_dataset_agrees() -> None:
    result = check_thread_safety(lambda: DataLoader(Squares(), batch_size=8), 4)
    assert ("agreed", 4, MAX_SAMPLES) == (result.verdict, result.threads, result.samples)
    assert MIN_PASSES <= result.passes <= MAX_PASSES
    assert not result.unsafe
    line = result.describe()
    assert "4 threads, starting their calls together, loaded the same 64 samples" in line
    assert f"as one thread, {result.passes} times over (a check, not a proof" in line


@pytest.mark.parametrize("batch_size", [8, None])
def test_a_shared_position_is_caught(batch_size: int | None) -> None:
    result = check_thread_safety(lambda: DataLoader(SharedPosition(), batch_size=batch_size), 4)
    assert "differed" == result.verdict
    assert result.unsafe
    assert result.differed is not None
    first, last = result.differed
    assert (last - first + 1) == (batch_size or 1)
    line = result.describe()
    assert "NOT thread-safe" in line
    assert "threads were not tried" in line
    assert "read with os.pread, or open each handle on first use in each thread" in line


def test_draws_from_the_global_generator_are_each_samples_own_and_checked() -> None:
    """torch.rand() in a loading thread draws from the sample's generator: loads agree."""
    result = check_thread_safety(lambda: DataLoader(GlobalNoise(), batch_size=8), 4)
    assert "agreed" == result.verdict, result.describe()


def test_draws_that_escape_the_samples_generator_cannot_be_checked() -> None:
    result = check_thread_safety(lambda: DataLoader(HeldGlobalNoise(), batch_size=8), 4)
    assert "random" == result.verdict
    assert not result.unsafe  # not known to be unsafe: threads are still tried
    assert "torch.thread_safe_generator()" in result.describe()


@pytest.mark.parametrize(
    "generator", [_worker_rng, _thread_safe_generator], ids=lambda f: f.__name__
)
def test_draws_from_the_samples_own_generator_agree(
    generator: Callable[[], torch.Generator | None],
) -> None:
    """From get_worker_info().rng, or from torch.thread_safe_generator() where torch has it."""
    if generator is _thread_safe_generator and not hasattr(torch, "thread_safe_generator"):
        pytest.skip(f"torch {torch.__version__} has no torch.thread_safe_generator()")
    result = check_thread_safety(lambda: DataLoader(OwnNoise(generator), batch_size=8), 4)
    assert "agreed" == result.verdict, result.why


def test_an_error_in_the_dataset_is_a_failed_check_not_an_exception() -> None:
    result = check_thread_safety(lambda: DataLoader(Fails(), batch_size=8), 4)
    assert ("failed", False) == (result.verdict, result.unsafe)
    assert "not checked: loading raised KeyError" in result.describe()


def test_a_dataset_that_raises_in_every_loading_thread_is_unsafe() -> None:
    """sqlite3 in __init__: one loading thread alone raises, this thread loads: "raised"."""
    result = check_thread_safety(lambda: DataLoader(SqliteRows(), batch_size=8), 4)
    assert ("raised", True) == (result.verdict, result.unsafe)
    assert result.why.startswith("ProgrammingError: SQLite objects created in a thread")
    line = result.describe()
    assert "NOT loadable by threads: one loading thread alone raised ProgrammingError" in line
    assert "works only in the thread that built it" in line
    assert "check_same_thread=False" in line


class BorrowedOnce(Squares):
    """Raises when called while another call is in progress, as a fast tokenizer does."""

    def __init__(self) -> None:
        self.busy = False
        self.barrier = threading.Barrier(2)

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.busy:
            raise RuntimeError("Already borrowed")
        self.busy = True
        try:
            info = torch.utils.data.get_worker_info()
            if info is not None and info.num_workers > 1:
                try:
                    self.barrier.wait(timeout=2)  # a second call comes meanwhile
                except threading.BrokenBarrierError:
                    self.barrier.reset()
            return super().__getitem__(i)
        finally:
            self.busy = False


def test_an_error_only_under_threads_is_unsafe() -> None:
    result = check_thread_safety(lambda: DataLoader(BorrowedOnce(), batch_size=8), 4)
    assert ("raised", True) == (result.verdict, result.unsafe)
    assert "RuntimeError: Already borrowed" in result.why
    line = result.describe()
    assert "NOT thread-safe: with 4 threads at once, loading raised RuntimeError" in line


class OwnGenerator(Squares):
    """Safe, but draws from a generator of its own: its samples differ from load to load."""

    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def __getitem__(self, i: int) -> torch.Tensor:
        return super().__getitem__(i) + torch.rand(2, generator=self.generator)


class Labelled:
    """A sample object without __eq__: equal only by its attributes."""

    def __init__(self, i: int) -> None:
        self.label, self.values = i, torch.arange(3) * i


class Objects(Squares):
    def __getitem__(self, i: int) -> Any:
        return Labelled(i)


def test_samples_that_vary_between_loads_cannot_be_checked() -> None:
    result = check_thread_safety(lambda: DataLoader(OwnGenerator(), batch_size=8), 4)
    assert ("random", False) == (result.verdict, result.unsafe)
    assert "two one-thread loads of the same samples differed" in result.why


@pytest.mark.parametrize("batch_size", [8, None])
def test_objects_are_compared_by_their_attributes(batch_size: int | None) -> None:
    def build() -> DataLoader[Any]:
        return DataLoader(Objects(), batch_size=batch_size, collate_fn=lambda batch: batch)

    assert "agreed" == check_thread_safety(build, 4).verdict


class RacyCache(Squares):
    """Fills a cache without a lock: a read between two writes finds another sample's entry."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}
        self.barrier = threading.Barrier(2)

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in self.cache.get("keys", ()):
            return self.cache["values"][self.cache["keys"].index(i)]  # type: ignore[no-any-return]
        self.cache["last"] = super().__getitem__(i)  # one slot shared by every call
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 1:
            try:
                self.barrier.wait(timeout=2)
            except threading.BrokenBarrierError:
                self.barrier.reset()
        value = self.cache["last"]
        self.cache.setdefault("keys", []).append(i)
        self.cache.setdefault("values", []).append(value)
        return value  # type: ignore[no-any-return]


def test_a_cache_filled_without_a_lock_is_caught_on_a_fresh_dataset() -> None:
    """Every threaded pass starts from a freshly built loader, so the cache fills under threads."""
    result = check_thread_safety(lambda: DataLoader(RacyCache(), batch_size=8), 4)
    assert ("differed", True) == (result.verdict, result.unsafe)


def test_the_check_leaves_the_global_generators_as_they_were() -> None:
    """Even a dataset that draws from them: the user's training sees the states it set."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    check_thread_safety(lambda: DataLoader(GlobalNoise(), batch_size=8), 4)
    assert torch.equal(expected[0], torch.rand(3))
    assert (expected[1], expected[2]) == (random.random(), np.random.rand())


def test_few_samples_are_checked_in_two_batches_at_least() -> None:
    small = torch.utils.data.Subset(Squares(), range(6))
    result = check_thread_safety(lambda: DataLoader(small, batch_size=32), 2)
    assert ("agreed", 2, 6) == (result.verdict, result.threads, result.samples)


def _factory(dataset: Dataset[Any]) -> Any:
    def make_loader(num_workers: int = 0) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=8, num_workers=num_workers)

    return make_loader


def test_tune_does_not_try_threads_on_a_dataset_that_is_not_thread_safe() -> None:
    result = nostall.tune(_factory(SharedPosition()), max_batches=60, device="cpu", max_workers=0)
    assert result.thread_safety is not None
    assert result.thread_safety.unsafe
    assert 2 == result.thread_safety.threads  # the most threads the climb would try (0 cores)
    assert all(s.threads is None for s, _ in result.curve)
    assert result.best.threads is None
    assert "differed" == result.to_dict()["thread_safety"]["verdict"]


def test_tune_tries_threads_on_a_dataset_that_agrees() -> None:
    result = nostall.tune(_factory(Squares()), max_batches=60, device="cpu", max_workers=0)
    assert result.thread_safety is not None
    assert "agreed" == result.thread_safety.verdict
    assert any(s.threads is not None for s, _ in result.curve)
