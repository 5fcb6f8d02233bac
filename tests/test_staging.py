"""Staging, driven directly: pin -> copy -> transform (and its checkpoint) -> ready event.

The CUDA path's stream safety end to end, with canaries, is in test_transfer_simulated.py; here,
the steps of one batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import CountingTransform
from simcuda import Simulation, simulated_cuda

from nostall._staging import CudaStaging, Staging

CPU = torch.device("cpu")


class Movable:
    """A batch object with its own ``to()`` (as a user's batch class may have)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.moved_to: list[torch.device] = []

    def to(self, device: torch.device, non_blocking: bool = False) -> Movable:
        self.moved_to.append(torch.device(device))
        return self


def test_a_batch_already_on_the_device_is_handed_out_as_it_is() -> None:
    t = torch.arange(4)
    staged = Staging(CPU).stage({"x": t, "names": ["a"]})
    assert staged.batch["x"] is t
    assert staged.batch["names"] == ["a"]
    assert (staged.ready, staged.tensors, staged.transform_state) == (None, [], None)
    assert Staging(CPU).hand_out(staged) is staged.batch


def test_an_object_with_to_is_moved_by_its_own_to() -> None:
    obj = Movable(torch.ones(2))
    Staging(CPU).stage([obj])
    assert obj.moved_to == [CPU]


def test_the_transform_checkpoint_is_taken_with_each_batch() -> None:
    """A batch's checkpoint is the transform's state right after that batch, not later."""
    staging = Staging(CPU, CountingTransform())
    first = staging.stage(torch.zeros(2))
    second = staging.stage(torch.zeros(2))
    assert first.batch.tolist() == [0, 0]
    assert second.batch.tolist() == [1, 1]
    assert first.transform_state == {"seen": 1}
    assert second.transform_state == {"seen": 2}


def test_a_transform_without_state_has_no_checkpoint() -> None:
    staging = Staging(CPU, lambda batch: batch * 2)
    staged = staging.stage(torch.ones(2))
    assert staged.batch.tolist() == [2, 2]
    assert staged.transform_state is None
    assert staging.transform_state() is None


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


# --- MPS: staged in the consumer's thread ----------------------------------------------------


def test_mps_stages_in_the_consumers_thread() -> None:
    """A second thread's MPS work can abort inside Metal: MPS batches move where the model runs."""
    from nostall._staging import ConsumerThreadStaging, staging_for

    assert isinstance(staging_for(torch.device("mps"), False, None), ConsumerThreadStaging)
    assert type(staging_for(torch.device("cpu"), False, None)) is Staging


class ThreadNotingTransform(CountingTransform):
    """A stateful transform that notes the thread it runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        import threading

        self.threads.append(threading.current_thread().name)
        return super().__call__(batch)


def test_consumer_thread_staging_transforms_at_hand_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetched ahead by the producer, transformed in the loop's thread.

    A state saved after a batch holds the transform's state right after that batch.
    """
    import threading

    import nostall
    from nostall import _prefetcher
    from nostall._staging import ConsumerThreadStaging

    def consumer_thread_staging(device: torch.device, pin: bool, transform: Any) -> Staging:
        return ConsumerThreadStaging(device, transform)

    monkeypatch.setattr(_prefetcher, "staging_for", consumer_thread_staging)
    data = [torch.full((2,), float(i)) for i in range(4)]
    transform = ThreadNotingTransform()
    p = nostall.prefetch(data, "cpu", transform=transform)
    got = []
    for batch in p:
        got.append(float(batch[0]))
        if len(got) == 2:
            saved = p.state_dict()
    assert [0.0, 2.0, 4.0, 6.0] == got  # batch i plus the i batches before it
    assert [threading.current_thread().name] * 4 == transform.threads
    resumed = nostall.prefetch(data, "cpu", transform=ThreadNotingTransform())
    resumed.load_state_dict(saved)
    assert [4.0, 6.0] == [float(b[0]) for b in resumed]


def test_copy_streams_taken_back_inside_a_take_back_do_not_deadlock() -> None:
    """A take-back inside a take-back (a staging collected meanwhile) does not deadlock.

    The garbage collector may finalise a staging in the thread holding the lock.
    """
    import threading

    from nostall._copy_streams import CopyStreams

    lender = CopyStreams()
    done = threading.Event()

    def nested() -> None:
        with lender._lock:
            lender._take_back(0, "a stream")  # type: ignore[arg-type]
        done.set()

    threading.Thread(target=nested, daemon=True).start()
    assert done.wait(10.0)
    assert 1 == lender.free_count(0)
