"""CUDA staging, driven directly: pin -> copy on the copy stream -> transform -> ready event.

The CUDA path's stream safety end to end, with canaries, is in test_transfer_simulated.py; here,
the steps of one batch, on the simulated CUDA.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import CountingTransform
from simcuda import Simulation, simulated_cuda

import nostall
from nostall._staging import cuda as _staging_cuda
from nostall._staging.cuda import CudaStaging
from nostall.cuda._tree import iter_tensors


@pytest.fixture
def sim() -> Iterator[Simulation]:
    with simulated_cuda() as s:
        yield s


def test_cuda_staging_copies_on_its_stream_and_records_the_ready_event(sim: Simulation) -> None:
    staging = CudaStaging(torch.device("cuda"), True)
    source = torch.arange(6)
    staged = staging.stage({"x": source})
    moved = staged.batch["x"]
    assert moved.is_cuda
    assert staged.ready is not None
    assert [t is moved for t in staged.tensors] == [True]  # to be record_stream-ed at hand-out
    batch: Any = staging.hand_out(staged)
    torch.cuda.synchronize()
    assert torch.equal(batch["x"].cpu(), source)
    assert sim.hazards == []


def test_cuda_staging_takes_the_transform_checkpoint_on_the_copy_side(sim: Simulation) -> None:
    staging = CudaStaging(torch.device("cuda"), True, CountingTransform())
    first = staging.stage(torch.zeros(2))
    second = staging.stage(torch.zeros(2))
    assert (first.transform_state, second.transform_state) == ({"seen": 1}, {"seen": 2})
    out = [staging.hand_out(first), staging.hand_out(second)]
    torch.cuda.synchronize()
    assert [o.cpu().tolist() for o in out] == [[0, 0], [1, 1]]
    assert sim.hazards == []


@contextlib.contextmanager
def counted(*names: str) -> Iterator[collections.Counter[str]]:
    """Count the calls to these ``torch.cuda`` functions (the simulation's) in the block."""
    calls: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(torch.cuda, name) for name in names}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return saved[name](*args, **kwargs)

        return call

    try:
        for name in names:
            setattr(torch.cuda, name, counting(name))
        yield calls
    finally:
        for name, function in saved.items():
            setattr(torch.cuda, name, function)


ASKED = ("stream", "device", "current_stream", "current_device")


def _per_batch(loop: Callable[[int], None]) -> dict[str, float]:
    """Calls per batch of :data:`ASKED` in ``loop(n)``: 4 batches' less 12's, setup cancelled."""
    with counted(*ASKED) as few:
        loop(4)
    with counted(*ASKED) as many:
        loop(12)
    return {name: (many[name] - few[name]) / 8 for name in ASKED}


def test_the_producer_sets_its_streams_without_asking_torch(sim: Simulation) -> None:
    """Per batch the producer thread enters no ``torch.cuda.stream``/``device`` context.

    Its device and resting stream are known from its start: the source and copy streams are
    set and the resting one set back directly. The consumer asks for its stream once, to
    wait on the batch's event.
    """

    def loop(n: int) -> None:
        batches = [(torch.zeros(8), torch.zeros(1, dtype=torch.int64)) for _ in range(n)]
        with nostall.prefetch(batches, "cuda", timeout=30.0) as p:  # the producer pulls all
            assert len(list(p)) == n

    assert _per_batch(loop) == {"stream": 0, "device": 0, "current_stream": 1, "current_device": 0}
    assert sim.hazards == []


def test_a_pull_in_the_consumer_reads_its_streams_once(sim: Simulation) -> None:
    """The consumer pulling a batch itself reads its device and stream once, sets them back.

    On a side stream of its own: the source runs on the source stream, the copy on the copy
    stream, and afterwards the side stream is current again, the target device too.
    """
    staging = CudaStaging(torch.device("cuda", 0), True)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]

    def loop(n: int) -> None:
        with torch.cuda.stream(side):
            for _ in range(n):
                with staging.pull_context():
                    with staging.source_context():
                        assert torch.cuda.current_stream() == staging.source_stream
                        batch = torch.zeros(4)
                    staged = staging.stage(batch)
                assert torch.cuda.current_stream() == side
                assert torch.cuda.current_device() == 0
                staging.hand_out(staged)

    calls = _per_batch(loop)  # less the loop's own asserts: 2 current_stream, 1 current_device
    assert calls == {"stream": 0, "device": 0, "current_stream": 2 + 2, "current_device": 1 + 1}
    assert sim.hazards == []


def test_a_pull_on_another_device_sets_the_device_back(sim: Simulation) -> None:
    """A consumer whose current device is not the target: torch's contexts, device restored."""
    staging = CudaStaging(torch.device("cuda", 1), True)
    with staging.pull_context():
        with staging.source_context():
            assert torch.cuda.current_device() == 1
            assert torch.cuda.current_stream(1) == staging.source_stream
        staged = staging.stage(torch.zeros(4))
        assert torch.cuda.current_device() == 0
    with torch.cuda.device(1):
        assert torch.cuda.current_stream() == torch.cuda.default_stream(1)
        staging.hand_out(staged)
    assert sim.hazards == []


def test_a_source_that_leaves_a_stream_set_does_not_keep_it(sim: Simulation) -> None:
    """Each call into the source starts on the source stream, and ends on the thread's own."""
    other = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    seen: list[torch.cuda.Stream] = []

    def leaky(n: int) -> Iterator[torch.Tensor]:
        for _ in range(n):
            seen.append(torch.cuda.current_stream())
            torch.cuda.set_stream(other)  # never set back
            yield torch.zeros(4)

    staging = CudaStaging(torch.device("cuda", 0), True)
    with staging.pull_context():
        it = leaky(2)
        for _ in range(2):
            with staging.source_context():
                batch = next(it)
            staging.hand_out(staging.stage(batch))
            assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert seen == [staging.source_stream] * 2
    assert sim.hazards == []


def test_a_batch_of_host_tensors_is_walked_once(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its copies are all the device tensors it will hold: the moved batch is not walked.

    A device tensor the batch already holds, or a tensor subclass (which may keep more
    tensors in attributes), and the moved batch is walked for every device tensor.
    """
    walks = []

    def walked(batch: Any) -> Iterator[torch.Tensor]:
        walks.append(type(batch).__name__)
        return iter_tensors(batch)

    monkeypatch.setattr(_staging_cuda, "iter_tensors", walked)
    staging = CudaStaging(torch.device("cuda", 0), True)
    staged = staging.stage((torch.zeros(2), {"y": torch.ones(3)}))
    assert walks == ["tuple"]
    copies = (staged.batch[0], staged.batch[1]["y"])
    assert [t is c for t, c in zip(staged.tensors, copies, strict=True)] == [True, True]
    for odd in (torch.zeros(2, device="cuda"), torch.nn.Parameter(torch.zeros(2))):
        walks.clear()
        staged = staging.stage((torch.zeros(2), odd))
        assert walks == ["tuple", "tuple"]
        assert len(staged.tensors) == 2
    torch.cuda.synchronize()
    assert sim.hazards == []


def _read(batch: Any) -> torch.Tensor:
    """The model's work on a batch: reads each tensor on the current stream."""
    return torch.stack([t.float().sum() for t in batch])


@pytest.mark.parametrize("consumer", ["default", "side"])
@pytest.mark.parametrize("kind", [tuple, list])
def test_a_small_batch_the_consumer_pulls_is_copied_on_its_own_stream(
    sim: Simulation, consumer: str, kind: Any
) -> None:
    """No event, no wait, no record_stream: the copy is in the consumer's stream order.

    The model's read right after it, with nothing waited for, is ordered (the simulation
    would report an unordered read otherwise), and a pageable tensor is pinned first.
    """
    staging = CudaStaging(torch.device("cuda", 0), True)
    side = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    batch = kind([torch.arange(6.0), torch.ones(3, dtype=torch.int64).pin_memory()])
    with torch.cuda.stream(side):
        with staging.pull_context():
            staged = staging.stage(batch)
        assert (staged.ready, staged.tensors) == (None, [])
        moved: Any = staging.hand_out(staged)
        assert type(moved) is kind
        assert moved is not batch
        assert all(t.is_cuda for t in moved)
        out = _read(moved)
        del moved, staged
        torch.zeros(64, device="cuda")  # may reuse the copies' memory: same stream, in order
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), torch.tensor([15.0, 3.0]))
    assert sim.hazards == []


def test_a_batch_over_the_limit_or_from_the_producer_goes_through_the_copy_stream(
    sim: Simulation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Larger batches keep the copy stream (they overlap the model's work), as the producer's do."""
    staging = CudaStaging(torch.device("cuda", 0), True)
    small = (torch.zeros(4), torch.zeros(1))
    monkeypatch.setattr(CudaStaging, "HERE_BYTES", 16)  # 20 bytes: over the limit
    with staging.pull_context():
        assert staging.stage(small).ready is not None
    monkeypatch.setattr(CudaStaging, "HERE_BYTES", 20)
    with staging.pull_context():
        assert staging.stage(small).ready is None
    assert staging.stage(small).ready is not None  # outside a consumer's pull: the producer's way
    torch.cuda.synchronize()
    assert sim.hazards == []


def test_without_pinning_a_small_pull_keeps_the_copy_stream(sim: Simulation) -> None:
    """pin_memory=False: a pageable copy on the consumer's stream would wait for its kernels."""
    staging = CudaStaging(torch.device("cuda", 0), False)
    with staging.pull_context():
        staged = staging.stage((torch.zeros(4), torch.zeros(1)))
    assert staged.ready is not None
    staging.hand_out(staged)
    torch.cuda.synchronize()
    assert [] == [h for h in sim.hazards if h.kind.name != "HOST_SYNC"]
