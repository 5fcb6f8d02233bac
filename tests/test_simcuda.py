"""The simulated CUDA itself: it finds each textbook hazard, and is silent on the correct pattern.

These tests give the simulation its teeth before it is trusted with nostall's code
(``test_transfer_simulated.py``): every hazard kind is provoked by a few lines of plain torch
code, next to the same lines with the protection in place.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from simcuda import Kind, SimTensor, Simulation, simulated_cuda


@pytest.fixture
def sim() -> Iterator[Simulation]:
    with simulated_cuda() as s:
        yield s


def test_values_are_computed_and_devices_reported(sim: Simulation) -> None:
    x = torch.arange(6.0).reshape(2, 3).to("cuda")
    y = (x * 2 + 1)[1]
    assert isinstance(y, SimTensor)
    assert y.device == torch.device("cuda", 0)
    assert y.is_cuda
    assert torch.equal(y.cpu(), torch.tensor([7.0, 9.0, 11.0]))
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 2
    assert sim.hazards == []


def test_torch_is_restored_afterwards() -> None:
    to, available = torch.Tensor.to, torch.cuda.is_available
    answer = torch.cuda.is_available()  # False here; True on a GPU machine (make gpu-check)
    with simulated_cuda():
        assert torch.Tensor.to is not to
        assert torch.cuda.is_available()
    assert torch.Tensor.to is to
    assert torch.cuda.is_available is available
    assert torch.cuda.is_available() == answer


def test_a_read_on_another_stream_needs_a_wait(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x * 2
    assert sim.kinds() == {Kind.UNORDERED}
    sim.hazards.clear()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2
    assert sim.hazards == []


def test_a_write_must_follow_reads_on_other_streams(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x * 2  # a read on the side stream
    x.add_(1)  # the default stream writes without waiting for it
    assert sim.kinds() == {Kind.UNORDERED}


def _read_on(stream: torch.cuda.Stream, x: torch.Tensor) -> torch.Tensor:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        return x * 2


def test_reuse_without_record_stream_is_found(sim: Simulation) -> None:
    consumer = torch.cuda.Stream()
    x = torch.ones(256, device="cuda")
    kept = _read_on(consumer, x)
    del x  # back to the default stream's pool at once: nothing recorded the consumer's read
    torch.full((256,), 3.0, device="cuda")  # same size, same stream: the block is reused
    assert sim.kinds() == {Kind.REUSE}
    assert "previous tenant" in sim.hazards[0].message
    assert kept.device.type == "cuda"


def test_record_stream_holds_the_block_until_the_host_saw_the_reader(sim: Simulation) -> None:
    consumer = torch.cuda.Stream()
    x = torch.ones(256, device="cuda")
    where = _address(sim, x)
    _read_on(consumer, x)
    x.record_stream(consumer)
    del x
    y = torch.full((256,), 3.0, device="cuda")  # elsewhere: the old block waits for the consumer
    assert sim.hazards == []
    assert _address(sim, y) != where
    torch.cuda.synchronize()
    z = torch.full((256,), 4.0, device="cuda")  # now the waiting block is reused, safely
    assert sim.hazards == []
    assert _address(sim, z) == where


def _address(sim: Simulation, t: torch.Tensor) -> str:
    block = sim.memory.block_of(t)
    assert block is not None
    return block.id


def test_host_syncs_in_a_nostall_thread_are_found(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda")
    errors: list[BaseException] = []

    def work() -> None:
        try:
            x.sum().item()
            torch.arange(3).to("cuda")  # pageable, blocking
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    thread = threading.Thread(target=work, name="nostall-prefetch-test")
    thread.start()
    thread.join()
    assert not errors
    assert [h.kind for h in sim.hazards] == [Kind.HOST_SYNC, Kind.HOST_SYNC]
    sim.hazards.clear()
    x.sum().item()  # the main thread on its default stream may wait
    assert sim.hazards == []


def test_non_blocking_from_pageable_memory_is_found(sim: Simulation) -> None:
    torch.ones(4).to("cuda", non_blocking=True)
    assert sim.kinds() == {Kind.PAGEABLE_NON_BLOCKING}
    sim.hazards.clear()
    pinned = torch.ones(4).pin_memory()
    assert pinned.is_pinned()
    assert pinned[1:].is_pinned()
    assert not torch.ones(4).is_pinned()
    pinned.to("cuda", non_blocking=True)
    assert sim.hazards == []


def test_a_copy_waiting_for_model_work_is_a_false_dependency(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda")
    copy = torch.cuda.Stream()
    copy.library = True  # as if nostall had made it
    with sim.model_work():
        x * 2
    copy.wait_stream(torch.cuda.current_stream())
    batch = torch.ones(4).pin_memory()
    with torch.cuda.stream(copy):
        batch.to("cuda", non_blocking=True)
    assert sim.kinds() == {Kind.FALSE_DEPENDENCY}
    sim.hazards.clear()
    torch.cuda.synchronize()  # the model work is finished and the host knows it
    with torch.cuda.stream(copy):
        batch.to("cuda", non_blocking=True)
    assert sim.hazards == []


def test_devices_are_not_mixed(sim: Simulation) -> None:
    a = torch.ones(4, device="cuda:0")
    b = torch.ones(4, device="cuda:1")
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(4)  # a CPU tensor with elements
    a + torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar, as in torch
    assert [h.kind for h in sim.hazards] == [Kind.WRONG_DEVICE, Kind.WRONG_DEVICE]
    sim.hazards.clear()
    a.record_stream(torch.cuda.Stream(1))
    assert sim.kinds() == {Kind.WRONG_DEVICE}


def test_streams_are_per_thread_and_per_device(sim: Simulation) -> None:
    side = torch.cuda.Stream(1)
    seen: list[torch.cuda.Stream] = []
    with torch.cuda.stream(side):
        assert torch.cuda.current_device() == 1
        assert torch.cuda.current_stream() == side
        thread = threading.Thread(target=lambda: seen.append(torch.cuda.current_stream(1)))
        thread.start()
        thread.join()
    assert seen == [torch.cuda.default_stream(1)]
    assert torch.cuda.current_device() == 0
    assert torch.cuda.current_stream(1) != side
