"""threads=: a DataLoader's batches loaded by threads, the same as the loader's own."""

from __future__ import annotations

import itertools
import random
import re
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    as_dataset,
    assert_same_batches,
    refused_thread_starts,
    wait_for_no_nostall_threads,
    wait_until,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import nostall
from nostall._epochs.epochs import EpochSource
from nostall._epochs.skip import skip_ahead
from nostall._loading.pool import Pool
from nostall._loading.threads import AHEAD_PER_THREAD, ThreadedEpoch, sample_seed
from nostall._sources.global_draws import unwatched
from nostall.bench._workloads import AugmentedJpegImages, jpeg_files


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (i, a draw from the sample's own generator); records what was fetched."""

    def __init__(self, n: int = 40, draw: bool = True) -> None:
        self.n, self.draw = n, draw
        self.fetched: list[int] = []
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.lock:
            self.fetched.append(i)
        if not self.draw:
            return torch.tensor([i]), torch.zeros(1)
        info = torch.utils.data.get_worker_info()  # the sample's own rng in a loading thread
        rng = None if info is None else info.rng
        generator = None if rng is None else rng.torch_generator
        return torch.tensor([i]), torch.rand(1, generator=generator)


def first_parts(batches: Any) -> list[list[int]]:
    return [b[0].flatten().tolist() for b in batches]


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize(
    "build",
    [
        lambda d, g: DataLoader(d, batch_size=4, shuffle=True, generator=g),
        lambda d, g: DataLoader(d, batch_size=3, shuffle=True, drop_last=True),
        lambda d, g: DataLoader(d, batch_size=None, shuffle=True, generator=g),
        lambda d, g: DataLoader(d, batch_sampler=[[3, 1], [0], [7, 5, 2]]),
    ],
    ids=["generator", "global-rng-drop-last", "no-batching", "batch-sampler"],
)
def test_same_batches_and_random_draws_as_the_loader_itself(build: Any, threads: int) -> None:
    """Two epochs: the loader's own batches, and the generators left as the loader leaves them."""
    g = torch.Generator()
    loader = build(Numbers(draw=False), g)  # the loop itself draws from no global generator
    g.manual_seed(5)
    torch.manual_seed(7)
    expected = [first_parts(loader) for _ in range(2)]
    after = (torch.get_rng_state(), g.get_state())
    g.manual_seed(5)
    torch.manual_seed(7)
    batches = nostall.prefetch(loader, "cpu", threads=threads)
    assert expected == [first_parts(batches) for _ in range(2)]
    assert torch.equal(after[0], torch.get_rng_state())
    assert torch.equal(after[1], g.get_state())


def test_a_sample_draws_the_same_numbers_whatever_thread_or_count_loads_it() -> None:
    """Per-sample random state: equal draws with 1 and 4 threads; a new epoch draws anew."""
    g = torch.Generator()
    loader = DataLoader(Numbers(), batch_size=4, shuffle=True, generator=g)
    draws = {}
    for threads in (1, 4):
        g.manual_seed(3)
        epochs = [list(nostall.prefetch(loader, "cpu", threads=threads)) for _ in range(1)]
        draws[threads] = torch.cat([b[1] for b in epochs[0]])
    torch.testing.assert_close(draws[1], draws[4], rtol=0, atol=0)
    g.manual_seed(3)
    twice = nostall.prefetch(loader, "cpu", threads=2)
    first, second = (torch.cat([b[1] for b in twice]) for _ in range(2))
    assert not torch.equal(first, second)  # another epoch, another base seed
    assert len({sample_seed(1, 2, 0), sample_seed(2, 1, 0), sample_seed(1, 0, 2)}) == 3


def test_thread_safe_generator_gives_the_samples_own_generator() -> None:
    """torch.thread_safe_generator() in a loading thread is the sample's generator."""
    if not hasattr(torch, "thread_safe_generator"):
        pytest.skip("this torch has no torch.thread_safe_generator()")

    class Draws(Dataset[torch.Tensor]):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> torch.Tensor:
            generator = torch.thread_safe_generator()
            info = torch.utils.data.get_worker_info()
            assert info is not None
            assert info.rng is not None
            assert generator is info.rng.torch_generator
            return torch.rand(1, generator=generator)

    draws = []
    for threads in (1, 3):
        torch.manual_seed(0)  # the base seed comes from the global generator here
        loader = DataLoader(Draws(), batch_size=2)
        draws.append(list(nostall.prefetch(loader, "cpu", threads=threads)))
    torch.testing.assert_close(torch.cat(draws[0]), torch.cat(draws[1]), rtol=0, atol=0)


def after_two_whole_and_resumed(
    build: Callable[[], DataLoader[Any]], seed: Callable[[], object], threads: int = 2
) -> tuple[list[Any], list[Any]]:
    """An epoch's batches after its second: uninterrupted (``threads``), and resumed (one more).

    ``seed()`` before each of the two runs that save the state; the resumed run is seeded
    otherwise (the state decides).
    """
    seed()
    whole = list(nostall.prefetch(build(), "cpu", threads=threads))
    seed()
    first = nostall.prefetch(build(), "cpu", threads=threads)
    it = iter(first)
    next(it), next(it)
    state = first.state_dict()
    torch.manual_seed(99)
    resumed = nostall.prefetch(build(), "cpu", threads=threads + 1)
    resumed.load_state_dict(state)
    return whole[2:], list(resumed)


def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew() -> None:
    """Per-sample random state follows the sample's place in the epoch, across a resume."""
    g = torch.Generator()
    whole, rest = after_two_whole_and_resumed(
        lambda: DataLoader(Numbers(), batch_size=4, shuffle=True, generator=g),
        lambda: g.manual_seed(2),
    )
    assert first_parts(whole) == first_parts(rest)
    torch.testing.assert_close(torch.cat([b[1] for b in whole]), torch.cat([b[1] for b in rest]))


def test_look_ahead_follows_the_room_it_is_given() -> None:
    """An epoch starts room() whole batches ahead, then two samples a thread, no more.

    Batches of 3 for 2 threads: the 4 samples past the room's are one batch and a part of the
    next, whose other samples start when it is asked for; every batch comes whole, in order.
    """
    pool = Pool(2, "nostall-load")
    for room in (0, 2):

        def given(r: int = room) -> int:
            return r

        epoch = ThreadedEpoch(DataLoader(as_dataset(list(range(20))), batch_size=3), pool, given)
        assert [0, 1, 2] == next(epoch).tolist()
        assert [3] * room + [3, 1] == [len(b.futures) for b in epoch.pending]
        expected = [list(range(k, min(k + 3, 20))) for k in range(3, 20, 3)]
        assert expected == [b.tolist() for b in epoch]


def test_no_batch_is_started_for_idle_threads_while_loading_in_step() -> None:
    """inline(): only the batch asked for is loaded, by the calling thread; none ahead."""
    data = Numbers(draw=False)
    loader = DataLoader(data, batch_size=1)
    epoch = ThreadedEpoch(loader, Pool(4, "nostall-load"), inline=lambda: True)
    assert [[0]] == first_parts([next(epoch)])
    assert ([0], 0) == (data.fetched, len(epoch.pending))


def test_a_resumed_epoch_gets_its_room_and_its_place() -> None:
    """After a resume the epoch still looks ahead, and numbers its batches from where it was."""
    loader = DataLoader(as_dataset(list(range(20))), batch_size=2)
    with unwatched():  # known to draw nothing: no batch is loaded in step (test_global_draws)
        epochs = EpochSource(loader, False, threads=2)
    epochs.room = lambda: 3
    resumed = skip_ahead(
        loader, 2, lambda loader, skipped: epochs._iterate(loader, skipped, epoch=0)
    )
    assert isinstance(resumed, ThreadedEpoch)
    assert (2, 3) == (resumed.batch, resumed.room())
    assert [4, 5] == next(resumed).tolist()


@pytest.mark.parametrize(("depth", "threads"), [(8, 2), (1, 6)])
def test_the_look_ahead_never_asks_the_sampler_past_its_length(depth: int, threads: int) -> None:
    """Taking len(loader) batches, as Lightning does, never exhausts the sampler's iterator."""
    asked_past_end = []

    class Counted:
        def __iter__(self) -> Any:
            yield from ([0, 1], [2, 3], [4, 5])
            asked_past_end.append(True)  # runs only when asked for a fourth batch

        def __len__(self) -> int:
            return 3

    loader = DataLoader(as_dataset(list(range(6))), batch_sampler=Counted())
    it = iter(nostall.prefetch(loader, "cpu", depth=depth, threads=threads))
    assert [[0, 1], [2, 3], [4, 5]] == [next(it).tolist() for _ in range(len(loader))]
    assert [] == asked_past_end
    with pytest.raises(StopIteration):
        next(it)  # asked for: now the sampler is asked, as a DataLoader's would be
    assert [True] == asked_past_end


@pytest.mark.parametrize(("depth", "threads"), [(3, 2), (1, 6)])
def test_a_sampler_error_comes_after_the_batches_before_it(depth: int, threads: int) -> None:
    """The batch sampler's own error in its place, then the epoch ends, as a DataLoader's."""
    failure = RuntimeError("the sampler broke")

    class Breaks:
        def __iter__(self) -> Any:
            yield from ([0, 1], [2, 3], [4, 5])
            raise failure

        def __len__(self) -> int:
            return 4

    def run(batches: Any) -> list[Any]:
        out: list[Any] = []
        it = iter(batches)
        while True:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                return out
            except RuntimeError as e:
                out.append(str(e))
                if len(out) > 6:
                    return out

    loader = DataLoader(as_dataset(list(range(6))), batch_sampler=Breaks())
    expected = run(loader)
    assert expected == [[0, 1], [2, 3], [4, 5], "the sampler broke"]
    assert expected == run(nostall.prefetch(loader, "cpu", depth=depth, threads=threads))


def test_worker_info_is_the_threads_own_and_the_main_thread_sees_none() -> None:
    """get_worker_info() in a loading thread: worker_method 'thread', its id and rng."""

    class Info(Dataset[tuple[str | None, int, int]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[str | None, int, int]:
            info = torch.utils.data.get_worker_info()
            assert info is not None
            return info.worker_method, info.id, info.num_workers

    loader = DataLoader(Info(), batch_size=None)
    seen = list(nostall.prefetch(loader, "cpu", threads=2))
    assert {("thread", 2)} == {(m, n) for m, _, n in seen}
    assert {i for _, i, _ in seen} <= {0, 1}
    assert torch.utils.data.get_worker_info() is None
    if hasattr(torch, "thread_safe_generator"):  # torch releases that have it
        assert torch.thread_safe_generator() is None


class InFlightTogether(Dataset[int]):
    """Each fetch waits (30 s at most) until ``together`` fetches are in flight at once.

    The pattern of PyTorch's ``test_worker_seed``: N workers (here N threads) must be fetching
    at the same time, from the very first sample.
    """

    def __init__(self, n: int, together: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(together, timeout=30)  # broken (raises) at the deadline
        self.wait = True

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if self.wait:
            self.barrier.wait()
        return i


def _stacked(samples: list[int]) -> torch.Tensor:
    return torch.tensor(samples)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    ("threads", "build"),
    [
        (4, lambda d: DataLoader(d, batch_size=4)),
        (4, lambda d: DataLoader(d, batch_size=4, shuffle=True)),  # its first pull not judged
        (4, lambda d: DataLoader(d, batch_size=4, collate_fn=_stacked)),
        (6, lambda d: DataLoader(d, batch_size=1)),  # torch's test_worker_seed: 6 workers, 1
        (6, lambda d: DataLoader(d, batch_size=1, shuffle=True)),
        (6, lambda d: DataLoader(d, batch_size=2, shuffle=True, generator=seeded(2))),
    ],
)
def test_the_first_batches_are_fetched_by_every_thread_too(threads: int, build: Any) -> None:
    """From the first sample on, N threads fetch at once, where no global draw is watched.

    Where it is watched (test_global_draws), the first batch's first sample is fetched alone
    to see whether it draws, so a dataset whose samples wait for one another waits there; here
    the source is known not to draw (as the thread-safety check loads it), and the batches,
    the loader's, need N fetches at once from the first sample on.
    """
    data = InFlightTogether(24, together=threads)  # 24 / threads rounds, each needs them all
    data.wait = False
    torch.manual_seed(5)
    expected = list(build(data))
    data.wait = True
    torch.manual_seed(5)
    with warnings.catch_warnings(), unwatched():
        warnings.simplefilter("error")  # no warning either
        batches = list(nostall.prefetch(build(data), "cpu", threads=threads))
    assert_same_batches(expected, batches)


def test_small_batches_keep_every_loading_thread_fetching() -> None:
    """batch_size=1, threads=6, depth=2: six samples in flight at once, the loader's batches."""
    data = InFlightTogether(24, together=6)  # 4 rounds of 6: every round needs all 6 threads
    g = torch.Generator()
    loader = DataLoader(data, batch_size=1, shuffle=True, generator=g)
    data.wait = False
    g.manual_seed(3)
    expected = list(loader)
    data.wait = True
    g.manual_seed(3)
    with unwatched():  # prefetching from the first batch on (see test_global_draws)
        batches = nostall.prefetch(loader, "cpu", depth=2, threads=6)
    assert_same_batches(expected, batches)


@pytest.mark.parametrize(
    ("depth", "size", "threads"), [(1, 3, 2), (2, 3, 2), (3, 3, 2), (2, 3, 3), (2, 1, 6)]
)
def test_threads_start_no_more_than_depth_batches_and_two_samples_per_thread_ahead(
    depth: int, size: int, threads: int
) -> None:
    """Samples started and not handed out stay within depth batches plus 2 x threads samples.

    ``taken`` counts the batches the loop body got; one more may be in the middle of being
    handed out (inside ``next()``), so the samples of batches up to ``taken + depth``, then
    ``AHEAD_PER_THREAD * threads`` more (started for threads that would be idle), are the
    furthest allowed. Checked at every fetch.
    """
    taken = [0]
    too_far: list[tuple[int, int]] = []

    class Watched(Dataset[int]):
        def __len__(self) -> int:
            return 60

        def __getitem__(self, i: int) -> int:
            if i >= (taken[0] + depth + 1) * size + AHEAD_PER_THREAD * threads:
                too_far.append((i, taken[0]))
            return i

    loader = DataLoader(Watched(), batch_size=size)
    for batch in nostall.prefetch(loader, "cpu", depth=depth, threads=threads):
        taken[0] += 1
        assert batch.tolist() == list(range(size * taken[0] - size, size * taken[0]))
    assert [] == too_far


def test_the_threads_load_the_next_batch_while_one_is_collated() -> None:
    """While the batch asked for is collated, the loading threads fetch the next one's samples.

    ``depth=1`` leaves no room ahead: the next batch is started only for the threads (two
    samples each). The collate of batch 0 waits (10 s at most) until sample 4, the next
    batch's first, was fetched; it is, by a loading thread, while that collate runs. Before,
    the threads waited for the next ``next()`` once the batch asked for was loaded.
    """
    fetched = threading.Event()
    waited: list[bool] = []

    class Counted(Dataset[int]):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> int:
            if i == 4:
                fetched.set()
            return i

    def collate(samples: list[int]) -> torch.Tensor:
        if samples[0] == 0:
            waited.append(fetched.wait(10))
        return torch.tensor(samples)

    loader = DataLoader(Counted(), batch_size=4, collate_fn=collate)
    with unwatched():  # no first sample loaded alone to see whether it draws
        batches = [b.tolist() for b in nostall.prefetch(loader, "cpu", depth=1, threads=2)]
    assert [list(range(k, k + 4)) for k in range(0, 16, 4)] == batches
    assert [True] == waited


def test_a_sample_error_arrives_in_order_as_the_users_exception_and_the_epoch_goes_on() -> None:
    """The batch holding a failing sample raises its exception, noted; the next batch follows."""
    boom = ValueError("sample 5 is broken")

    class Broken(Dataset[int]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> int:
            if i == 5:
                raise boom
            return i

    it = iter(nostall.prefetch(DataLoader(Broken(), batch_size=3), "cpu", threads=3))
    assert [0, 1, 2] == next(it).tolist()
    with pytest.raises(ValueError, match="sample 5 is broken") as info:
        next(it)
    assert info.value is boom
    assert any(
        "dataset[5]" in note and "nostall-load" in note for note in getattr(boom, "__notes__", [])
    )
    assert [[6, 7, 8], [9, 10, 11]] == [b.tolist() for b in it]  # as a DataLoader goes on


@pytest.mark.parametrize("how", ["break", "close", "drop"])
def test_break_close_and_gc_leave_no_thread(how: str) -> None:
    """Every loading and prefetch thread ends."""
    batches = nostall.prefetch(DataLoader(Numbers(400), batch_size=2), "cpu", threads=4)
    it = iter(batches)
    next(it)
    if how == "close":
        batches.close()
    elif how == "drop":
        del it, batches
    else:
        it.close()
    assert [] == wait_for_no_nostall_threads(timeout=10)


def test_set_epoch_resume_transform_and_profile_work_as_without_threads() -> None:
    """A DistributedSampler's epochs, a mid-epoch resume, a transform and the profile."""
    data = Numbers(24)

    def build() -> Any:
        sampler: DistributedSampler[int] = DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=4
        )
        return DataLoader(data, batch_size=4, sampler=sampler)

    plain = build()
    expected = []
    for epoch in range(2):
        plain.sampler.set_epoch(epoch)
        expected.append([b[0].flatten().add(100).tolist() for b in plain])
    first = nostall.prefetch(
        build(), "cpu", threads=2, transform=lambda b: [b[0] + 100, b[1]], profile=True
    )
    got = []
    for epoch in range(2):
        first.set_epoch(epoch)
        got.append([b[0].flatten().tolist() for b in first])
    assert expected == got
    assert 12 == first.report().batches
    resumed_from = nostall.prefetch(build(), "cpu", threads=2)
    resumed_from.set_epoch(1)
    it = iter(resumed_from)
    next(it), next(it)
    state = resumed_from.state_dict()
    fresh = nostall.prefetch(build(), "cpu", threads=3)
    fresh.load_state_dict(state)
    assert [[x - 100 for x in b] for b in expected[1][2:]] == first_parts(fresh)


def test_across_epochs_opens_each_epoch_as_the_loader_would() -> None:
    """across_epochs: each epoch's shuffle is the one the loader's own loop draws."""
    g = torch.Generator()
    loader = DataLoader(Numbers(draw=False), batch_size=5, shuffle=True, generator=g)
    g.manual_seed(9)
    expected = [first_parts(loader) for _ in range(3)]
    g.manual_seed(9)
    batches = nostall.prefetch(loader, "cpu", threads=2, across_epochs=True)
    assert expected == [first_parts(batches) for _ in range(3)]


@pytest.mark.parametrize(
    ("source", "threads", "error", "message"),
    [
        (
            DataLoader(as_dataset(range(4))),
            "2",
            TypeError,
            "threads=...) must be an int >= 1 or None",
        ),
        (DataLoader(as_dataset(range(4))), 0, ValueError, "must be >= 1 (got 0)"),
        ([1, 2], 2, TypeError, "got list: pass the DataLoader itself"),
        (
            DataLoader(as_dataset(range(4)), num_workers=2),
            2,
            ValueError,
            "build it with num_workers=0",
        ),
    ],
)
def test_what_threads_cannot_load_is_refused_with_the_fix(
    source: Any, threads: Any, error: type[Exception], message: str
) -> None:
    """Wrong types raise TypeError, wrong values ValueError, each saying what to pass."""
    with pytest.raises(error, match=re.escape(message)):
        nostall.prefetch(source, "cpu", threads=threads)


def test_a_thread_count_past_the_maximum_is_refused() -> None:
    """threads=10_000 started hundreds of threads: past MAX_THREADS it is a ValueError."""
    with pytest.raises(ValueError, match=re.escape("must be <= 256 (got 10000)")):
        nostall.prefetch(DataLoader(as_dataset(range(4))), "cpu", threads=10_000)
    assert [[0, 1, 2, 3]] == [
        b.tolist()
        for b in nostall.prefetch(
            DataLoader(as_dataset(range(4)), batch_size=4), "cpu", threads=256
        )
    ]


def test_a_datapipe_is_refused() -> None:
    """A datapipe is seeded and sharded by torch's own iterator: threads would bypass that."""
    from torch.utils.data.datapipes.iter import IterableWrapper

    with pytest.raises(ValueError, match="datapipe"):
        nostall.prefetch(DataLoader(IterableWrapper(range(4))), "cpu", threads=2)


def test_an_own_iter_is_refused() -> None:
    """An iteration threads would bypass: refused, never bypassed."""

    class Own(DataLoader[Any]):
        def __iter__(self) -> Any:
            return super().__iter__()

    with pytest.raises(ValueError, match="iterates in its own way"):
        nostall.prefetch(Own(as_dataset(range(3))), "cpu", threads=2)


def test_a_dataset_with_getitems_gets_whole_batches() -> None:
    """__getitems__ is called with a batch's indices, as the DataLoader calls it."""

    class Batched(Numbers):
        def __getitems__(self, indices: list[int]) -> list[Any]:
            return [(torch.tensor([i]), torch.zeros(1)) for i in indices]

    loader = DataLoader(Batched(10), batch_size=4)
    assert_same_batches(list(loader), nostall.prefetch(loader, "cpu", threads=2))


# -- pin_memory=True: pinned as the loader's own iterator pins --------------------------------


def test_pin_memory_is_decided_as_the_loaders_iterator_decides() -> None:
    """The premise: the same rule as _BaseDataLoaderIter, on this machine, GPU or not.

    Without an accelerator neither pins (and torch's iterator says so); with one both do.
    """
    from nostall._torch_compat import pinning_like

    plain = DataLoader(Numbers(), batch_size=4, pin_memory=False)
    assert pinning_like(plain) is None
    assert not iter(plain)._pin_memory
    pinning = DataLoader(Numbers(), batch_size=4, pin_memory=True)
    if torch.accelerator.is_available():
        pins = iter(pinning)._pin_memory
    else:
        with pytest.warns(UserWarning, match="no accelerator is found"):
            pins = iter(pinning)._pin_memory
        assert not pins
    assert pins == (pinning_like(pinning) is not None)


def test_pin_memory_batches_go_through_torchs_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an accelerator (pretended), every batch is pinned with torch's own helper.

    As the loader's iterator pins it: the same calls, the same batches.
    """
    from torch.utils.data._utils import pin_memory as pin_memory_utils

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    pinned: list[tuple[int, str]] = []

    def pin(batch: Any, device: str) -> Any:
        pinned.append((int(batch[0][0]), device))
        return [batch[0] + 1000, batch[1]]  # marked: the pinned copy is what is handed out

    monkeypatch.setattr(pin_memory_utils, "pin_memory", pin)
    loader = DataLoader(Numbers(12, draw=False), batch_size=4, pin_memory=True)
    expected = first_parts(loader)
    by_loader, pinned[:] = list(pinned), []
    assert first_parts(nostall.prefetch(loader, "cpu", threads=2)) == expected
    assert by_loader == pinned == [(0, "cuda"), (4, "cuda"), (8, "cuda")]
    assert [1000, 1001, 1002, 1003] == expected[0]


@pytest.mark.cuda
def test_pin_memory_batches_are_pinned_on_a_gpu_machine() -> None:
    loader = DataLoader(Numbers(12), batch_size=4, pin_memory=True)
    batches = list(nostall.prefetch(loader, "cpu", threads=2))
    assert all(b[0].is_pinned() and b[1].is_pinned() for b in batches)


class _MadeOnTheGpu(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample made on the current device; notes the stream its thread ran it on."""

    def __init__(self, n: int) -> None:
        self.n, self.streams = n, set[int]()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.streams.add(torch.cuda.current_stream().stream_id)
        return torch.full((1024,), float(i), device="cuda")


@pytest.mark.cuda
def test_loading_threads_do_gpu_work_on_the_source_stream() -> None:
    """Not on the legacy default stream (seen on an H100 before): on the prefetcher's own."""
    dataset = _MadeOnTheGpu(64)
    p = nostall.prefetch(DataLoader(dataset, batch_size=8), "cuda", threads=2)
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(consumer):
        sums = [float(b.sum()) for b in p]
    assert [1024.0 * sum(range(8 * k, 8 * k + 8)) for k in range(8)] == sums
    assert {p._staging.source_stream.stream_id} == dataset.streams  # type: ignore[attr-defined]


def test_a_worker_init_fn_is_not_called_and_the_user_is_told() -> None:
    called: list[int] = []

    def open_per_worker(worker_id: int) -> None:
        called.append(worker_id)

    loader = DataLoader(Numbers(8), batch_size=4, worker_init_fn=open_per_worker)
    with pytest.warns(
        UserWarning, match=r"worker_init_fn \('.*open_per_worker'\) is not called"
    ) as w:
        batches = list(nostall.prefetch(loader, "cpu", threads=2))
    assert __file__ == w[0].filename  # at the user's line
    assert "threading.local(), get_worker_info().id" in str(w[0].message)
    assert 2 == len(batches)
    assert [] == called


def test_refused_loading_threads_fail_their_batch_with_the_os_error_then_load() -> None:
    """Every slot refused by the OS: that batch raises the OS's error once; the rest load."""
    loader = DataLoader(as_dataset(list(range(24))), batch_size=4)
    with unwatched():  # no batch loaded in the consumer's thread first: the pool starts at once
        p = nostall.prefetch(loader, threads=2, timeout=30)
    got: list[Any] = []
    it = iter(p)
    with refused_thread_starts("nostall-load", refusals=2) as refused:  # both workers' slots
        for _ in range(6):
            try:
                got.append(next(it).tolist())
            except RuntimeError as e:
                got.append(str(e))
    assert ["nostall-load-0", "nostall-load-0"] == refused
    assert ["can't start new thread"] + [list(range(i, i + 4)) for i in range(4, 24, 4)] == got
    p.close()
    wait_for_no_nostall_threads()


def test_a_refused_loading_thread_leaves_the_running_ones_loading() -> None:
    """One loading thread of two is refused: one warning, every batch, in order."""
    loader = DataLoader(as_dataset(list(range(24))), batch_size=4)
    with (
        refused_thread_starts("nostall-load-1") as refused,
        pytest.warns(RuntimeWarning, match="could not start loading thread"),
    ):
        got = [b.tolist() for b in nostall.prefetch(loader, threads=2)]
    assert refused
    assert [list(range(i, i + 4)) for i in range(0, 24, 4)] == got
    wait_for_no_nostall_threads()


def each_next(batches: Any, on_error: Callable[[RuntimeError], str]) -> list[Any]:
    """Each batch as an int, and ``on_error(error)`` for each RuntimeError, until the end."""
    got: list[Any] = []
    it = iter(batches)
    while True:
        try:
            got.append(int(next(it)))
        except StopIteration:
            return got
        except RuntimeError as e:
            got.append(on_error(e))


class _StuckAt3(Dataset[int]):
    """Sample 3 waits for ``release`` while ``stuck``; the others return at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stuck = True

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 3 and self.stuck:
            self.release.wait(60)
        return i


@pytest.mark.parametrize("threads", [1, 3])
def test_a_timed_out_sample_keeps_its_batchs_turn(threads: int) -> None:
    """The loader's timeout=: the slow sample's batch comes at the next next(), as torch's."""
    data = _StuckAt3()
    loader = DataLoader(data, batch_size=1, timeout=0.5)
    errors: list[RuntimeError] = []

    def timed_out(error: RuntimeError) -> str:
        errors.append(error)
        if len(errors) == 2:
            data.release.set()  # a slow sample, not a stuck one
        return str(error).split(":")[0]

    with unwatched():
        p = nostall.prefetch(loader, threads=threads, depth=8, timeout=60)
    try:
        got = each_next(p, timed_out)
    finally:
        data.release.set()
        p.close()
    said = "DataLoader timed out after 0.5 seconds"  # twice: the batch waits again
    assert [0, 1, 2, said, said, 3, 4, 5, 6, 7] == got
    wait_for_no_nostall_threads()


class SlowFirst(Dataset[torch.Tensor]):
    """Six samples; the first waits for ``release``."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 0:
            self.release.wait(60)
        return torch.tensor([i])


def test_a_slow_first_batch_under_a_loader_timeout_is_each_batch_once() -> None:
    """The timeout covers the first batch too, which then comes; every batch once, in order.

    An unjudged source's first batch is not fetched on trial under a loader ``timeout=`` (a
    trial awaits all its samples, and would raise the timeout for another batch): its samples
    are loaded one at a time, each in a loading thread, the timeout bounding each wait.
    """
    data = SlowFirst()
    loader = DataLoader(data, batch_size=1, timeout=1.5)

    def timed_out(error: RuntimeError) -> str:
        data.release.set()
        return str(error).split(" at ")[0]

    with nostall.prefetch(loader, threads=4) as batches:
        got = each_next(batches, timed_out)
    said = "DataLoader timed out after 1.5 seconds: dataset[0] in 'nostall-load-0'"
    assert [said, 0, 1, 2, 3, 4, 5] == got


class HeldAtFourAndFive(Dataset[torch.Tensor]):
    """Samples 4 and 5 wait for ``release`` (both loading threads busy); the rest return."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: set[int] = set()

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i in (4, 5):
            self.started.add(i)
            self.release.wait(30)
        return torch.tensor([i])


def test_an_epoch_let_go_mid_batch_collates_no_batch_with_holes() -> None:
    """Samples 6 and 7 never start: the batch is refused, not collated with None.

    close() or a new iter() from another thread lets the epoch go while a batch loads. The
    samples not started were given back as None: a TypeError from the collate, or a batch
    holding None where the collate takes anything (22 of 60 rounds).
    """
    data = HeldAtFourAndFive()
    pool = Pool(2, "nostall-load")
    epoch = ThreadedEpoch(DataLoader(data, batch_size=4), pool, lambda: 0)
    assert [[0], [1], [2], [3]] == next(epoch).tolist()
    outcome: list[Any] = []

    def second() -> None:
        try:
            outcome.append(next(epoch))
        except Exception as e:
            outcome.append(e)

    loading = threading.Thread(target=second)
    loading.start()
    wait_until(lambda: data.started == {4, 5}, "samples 4 and 5 loading", timeout=30.0)
    epoch.let_go()  # as close() does, from another thread
    data.release.set()
    loading.join(30)
    assert not loading.is_alive()
    assert 1 == len(outcome)
    assert isinstance(outcome[0], nostall.PrefetcherClosedError), outcome
    assert "while dataset[6] of its batch was to load" in str(outcome[0])


def test_after_a_sample_stuck_for_good_the_next_epoch_completes() -> None:
    """A timeout, a break, then a whole epoch: the stuck thread no longer holds its place."""
    data = _StuckAt3()
    loader = DataLoader(data, batch_size=2, timeout=1)
    with unwatched():
        p = nostall.prefetch(loader, threads=1, timeout=60)  # its one place is held
    try:
        it = iter(p)
        assert [0, 1] == next(it).tolist()
        with pytest.raises(RuntimeError, match=r"timed out after 1 seconds: dataset\[3\]"):
            next(it)
        del it  # a break
        data.stuck = False  # the next epoch's sample 3 returns; the old one is still stuck
        assert [[0, 1], [2, 3], [4, 5], [6, 7]] == [b.tolist() for b in p]
    finally:
        data.release.set()
        p.close()
    wait_for_no_nostall_threads()


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator pins the batches")
def test_pin_memory_without_an_accelerator_is_warned_as_the_loader_warns() -> None:
    """threads= replaces the loader's iterator, which warns so at each epoch's start."""
    data = SlowFirst()
    data.release.set()  # no sample waits
    loader = DataLoader(data, batch_size=3, pin_memory=True)
    message = "'pin_memory' argument is set as true but no accelerator is found"
    with pytest.warns(UserWarning, match=message):
        expected = list(loader)
    with nostall.prefetch(loader, threads=2) as p, pytest.warns(UserWarning, match=message):
        assert_same_batches(expected, list(p))


class Augmented(Dataset[torch.Tensor]):
    """Sample i with draws from torch's, Python's and NumPy's global generators.

    The second, third and fourth fetches (the first batch's, after its first sample, judged
    alone) wait (30 s at most) until all three are fetched at once: loaded one at a time,
    they raise instead (a broken barrier).
    """

    def __init__(self, n: int = 48) -> None:
        self.n = n
        self.together = threading.Barrier(3, timeout=30)
        self.fetches = itertools.count()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if next(self.fetches) in (1, 2, 3):
            self.together.wait()
        draws = [torch.rand(()).item(), random.random(), float(np.random.rand())]
        return torch.tensor([i, *draws], dtype=torch.float64)


def masked(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws, as a language-modelling collator masks tokens."""
    stacked = torch.stack(samples)
    return stacked * torch.bernoulli(torch.full(stacked.shape, 0.9, dtype=stacked.dtype))


def augmented_epochs(threads: int, epochs: int = 2, **loader: Any) -> list[torch.Tensor]:
    """Two epochs of Augmented, seeded as a user seeds a run; no warning is given."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    source = DataLoader(Augmented(), batch_size=4, shuffle=True, **loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prefetcher = nostall.prefetch(source, "cpu", threads=threads)
        batches = [torch.cat(list(prefetcher)) for _ in range(epochs)]
    assert not prefetcher._lineage.epochs.draws.in_step  # prefetching
    return batches


@pytest.mark.parametrize("collate", [None, masked], ids=["default", "drawing-collate"])
def test_global_draws_under_threads_load_in_parallel_and_repeat_whatever_the_count(
    collate: Any,
) -> None:
    """The samples' and collate's draws are their own: the same batches with 2, 3 or 4 threads.

    Each sample draws from the global entry points (torch.rand, random.random,
    np.random.rand), routed to its own generators: loaded in parallel (three samples of the
    first batch meet), no warning, and a run repeats itself, epoch by epoch.
    """
    loader = {} if collate is None else {"collate_fn": collate}
    runs = [augmented_epochs(threads, **loader) for threads in (3, 4, 3)]
    for run in runs[1:]:
        for expected, epoch in zip(runs[0], run, strict=True):
            torch.testing.assert_close(expected, epoch, rtol=0, atol=0)
    first, second = runs[0]
    assert not torch.equal(first[:, 1:], second[:, 1:])  # another epoch, other draws


def test_global_draws_of_a_resumed_epoch_are_the_uninterrupted_ones() -> None:
    whole, rest = after_two_whole_and_resumed(
        lambda: DataLoader(Augmented(), batch_size=4, shuffle=True, collate_fn=masked),
        lambda: torch.manual_seed(2),
        threads=3,  # three of Augmented's first samples meet
    )
    torch.testing.assert_close(torch.cat(whole), torch.cat(rest), rtol=0, atol=0)


class RecordedAugmentedJpeg(AugmentedJpegImages):
    """The bench's augmented JPEG pipeline, each sample's area fraction and flip recorded."""

    def __init__(self, paths: list[Any], length: int) -> None:
        super().__init__(paths, size=16, length=length)
        self.drawn: list[tuple[float, bool]] = []

    def augmentation(self, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        box, flip = super().augmentation(width, height)
        left, top, right, bottom = box
        self.drawn.append(((right - left) * (bottom - top) / (width * height), flip))
        return box, flip


def test_a_torchvision_style_jpeg_pipeline_repeats_and_draws_as_the_plain_loop(
    tmp_path: Any,
) -> None:
    """Random resized crops and flips from torch's global generator, on PIL images.

    Under threads= the batches repeat run to run whatever the count; each sample's draws have
    the plain loop's distribution (other values: each sample draws from its own generator).
    """
    paths = jpeg_files(str(tmp_path), 6)
    length = 192

    def run(threads: int | None) -> tuple[list[Any], list[tuple[float, bool]]]:
        torch.manual_seed(0)
        dataset = RecordedAugmentedJpeg(paths, length)
        loader = DataLoader(dataset, batch_size=8, shuffle=True)
        if threads is None:
            return list(loader), dataset.drawn
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return list(nostall.prefetch(loader, "cpu", threads=threads)), dataset.drawn

    plain, plain_drawn = run(None)
    threaded, drawn = run(2)
    assert_same_batches(threaded, run(4)[0])
    assert_same_batches(threaded, run(2)[0])
    assert [b[1].tolist() for b in plain] == [b[1].tolist() for b in threaded]  # the order
    assert length == len(drawn) == len(plain_drawn)
    # The same distribution (seeded: these figures are the same on every run): the flip
    # rate, and the crop's area fraction, uniform over 35-100% of the image in both.
    flips = [sum(flip for _, flip in d) / length for d in (plain_drawn, drawn)]
    assert all(0.4 < rate < 0.6 for rate in flips), flips
    areas = [sorted(area for area, _ in d) for d in (plain_drawn, drawn)]
    distance = max(abs(a - b) for a, b in zip(*areas, strict=True))
    assert distance < 0.05, distance  # the two sorted samples' largest gap (a Q-Q plot's)
    assert 0.33 <= min(areas[1])  # 35%, less the rounding of a small crop
    assert max(areas[1]) <= 1.0
    assert plain_drawn != drawn  # not the plain loop's values
