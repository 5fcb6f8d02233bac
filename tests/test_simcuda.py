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
from simcuda import Kind, SimStream, SimTensor, Simulation, simulated_cuda


@pytest.fixture
def sim() -> Iterator[Simulation]:
    with simulated_cuda() as s:
        yield s


def as_if_nostall_made(stream: torch.cuda.Stream) -> None:
    """Mark ``stream`` (a ``SimStream`` in the simulation) as one nostall created."""
    simulated: object = stream
    assert isinstance(simulated, SimStream)
    simulated.library = True


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
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
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
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
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
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    x = torch.ones(256, device="cuda")
    kept = _read_on(consumer, x)
    del x  # back to the default stream's pool at once: nothing recorded the consumer's read
    torch.full((256,), 3.0, device="cuda")  # same size, same stream: the block is reused
    assert sim.kinds() == {Kind.REUSE}
    assert "previous tenant" in sim.hazards[0].message
    assert kept.device.type == "cuda"


def test_record_stream_holds_the_block_until_the_host_saw_the_reader(sim: Simulation) -> None:
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
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
    copy = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    as_if_nostall_made(copy)
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
    a.record_stream(torch.cuda.Stream(1))  # type: ignore[no-untyped-call]
    assert sim.kinds() == {Kind.WRONG_DEVICE}


def test_streams_are_per_thread_and_per_device(sim: Simulation) -> None:
    side = torch.cuda.Stream(1)  # type: ignore[no-untyped-call]
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


# --- the caching allocator: rounding, pools, best fit, splitting, merging ---------------------


def test_sizes_are_rounded_and_segments_reserved_as_pytorch_does(sim: Simulation) -> None:
    small = torch.empty(100, dtype=torch.uint8, device="cuda")  # 512 B of a 2 MiB segment
    assert torch.cuda.memory_allocated() == 512
    assert torch.cuda.memory_reserved() == 2 * 2**20
    large = torch.empty(2**20 + 1, dtype=torch.uint8, device="cuda")  # large pool: 20 MiB
    assert torch.cuda.memory_reserved() == 22 * 2**20
    split = torch.empty(11 * 2**20, dtype=torch.uint8, device="cuda")  # the rest of the 20 MiB
    assert torch.cuda.memory_reserved() == 22 * 2**20
    huge = torch.empty(29 * 2**20 + 1, dtype=torch.uint8, device="cuda")  # its own, to 2 MiB
    assert torch.cuda.memory_reserved() == 52 * 2**20
    del small, large, split, huge
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0


def test_a_smaller_tensor_takes_the_best_fitting_free_block_split(sim: Simulation) -> None:
    a = torch.empty(4096, dtype=torch.uint8, device="cuda")
    b = torch.empty(8192, dtype=torch.uint8, device="cuda")
    keep = torch.empty(512, dtype=torch.uint8, device="cuda")  # b is not next to the free tail
    where_b = _address(sim, b)
    del a, b
    c = torch.empty(3000, dtype=torch.uint8, device="cuda")  # a's and b's blocks merged: 12 KiB
    assert _address(sim, c) == _address(sim, c).split("+")[0] + "+0"
    d = torch.empty(6000, dtype=torch.uint8, device="cuda")  # the rest of that block, split
    assert _address(sim, d) != where_b  # 3072 B in, where b's memory began at 4096
    assert torch.cuda.memory_reserved() == 2 * 2**20
    assert keep.device.type == "cuda"
    assert sim.hazards == []


def test_reuse_of_part_of_a_larger_block_without_record_stream_is_found(sim: Simulation) -> None:
    """The hazard a same-size-only allocator cannot see: a smaller tenant in a larger's memory."""
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    big = torch.ones(2048, device="cuda")
    fence = torch.ones(128, device="cuda")  # keeps big's block from merging with the free tail
    kept = _read_on(consumer, big)
    del big
    torch.full((1000,), 3.0, device="cuda")  # best fit: the front of big's block
    assert sim.kinds() == {Kind.REUSE}
    assert fence.device.type == kept.device.type == "cuda"


# --- time: queries are not syncs; device-to-host copies are asynchronous ----------------------


def test_a_query_is_done_only_once_the_host_knows(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda") * 2
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    stream = torch.cuda.current_stream()
    assert not event.query()  # type: ignore[no-untyped-call]
    assert not stream.query()
    sim.time_passes()  # the GPU caught up; nobody waited
    assert event.query()  # type: ignore[no-untyped-call]
    assert stream.query()
    x.add_(1)
    assert not stream.query()
    torch.cuda.synchronize()
    assert stream.query()
    assert sim.hazards == []


def test_polling_is_not_taken_for_a_sync(sim: Simulation) -> None:
    """A copy stream that polled the model's event has not waited for it: a false dependency."""
    x = torch.ones(4, device="cuda")
    copy = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    as_if_nostall_made(copy)
    with sim.model_work():
        x * 2
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    assert not done.query()  # type: ignore[no-untyped-call]  # the old model answered "done" and took it as a sync
    copy.wait_event(done)
    with torch.cuda.stream(copy):
        torch.ones(4).pin_memory().to("cuda", non_blocking=True)
    assert sim.kinds() == {Kind.FALSE_DEPENDENCY}


def test_a_non_blocking_download_is_read_only_after_a_sync(sim: Simulation) -> None:
    x = torch.arange(4.0, device="cuda") * 2
    host = x.to("cpu", non_blocking=True)
    assert host.is_pinned()
    assert host.shape == (4,)  # its description is there at once
    assert sim.hazards == []
    host.sum()  # its values are not, yet
    assert sim.kinds() == {Kind.UNSYNCED_HOST_READ}
    sim.hazards.clear()
    later = x.to("cpu", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(later, torch.arange(4.0) * 2)
    assert sim.hazards == []


def test_a_non_blocking_download_does_not_block_a_nostall_thread(sim: Simulation) -> None:
    x = torch.ones(4, device="cuda")
    thread = threading.Thread(target=lambda: x.to("cpu", non_blocking=True), name="nostall-t")
    thread.start()
    thread.join()
    assert sim.hazards == []


# --- devices and contexts, as torch.cuda.stream and torch.cuda.device set them ---------------


def test_leaving_a_stream_of_another_device_sets_the_previous_device_eagerly(
    sim: Simulation,
) -> None:
    side = torch.cuda.Stream(1)  # type: ignore[no-untyped-call]
    assert sim.contexts == {1}
    with torch.cuda.device(1):  # entering sets eagerly, leaving only notes device 0
        pass
    assert sim.contexts == {1}
    assert torch.cuda.current_device() == 0
    with torch.cuda.stream(side):
        assert torch.cuda.current_device() == 1
    assert torch.cuda.current_device() == 0
    assert sim.contexts == {0, 1}  # set_stream(device 0's stream): cudaSetDevice(0)
    assert sim.hazards == []


def test_a_nostall_thread_making_a_context_on_an_unused_device_is_found(sim: Simulation) -> None:
    torch.cuda.set_device(1)
    side = torch.cuda.Stream(1)  # type: ignore[no-untyped-call]

    def work() -> None:
        with torch.cuda.stream(side):  # current device 0 in a new thread: back to it after
            torch.ones(2, device="cuda:1")

    thread = threading.Thread(target=work, name="nostall-t")
    thread.start()
    thread.join()
    assert sim.kinds() == {Kind.STRAY_CONTEXT}


# --- graph capture ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_rules(sim: Simulation, mode: str) -> None:
    """What CUDA forbids during capture, by mode; other threads' own streams are free."""
    x = torch.ones(4, device="cuda")
    copy = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    as_if_nostall_made(copy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=mode):
        capture = torch.cuda.current_stream()
        assert torch.cuda.is_current_stream_capturing()
        y = x * 2
        seen: list[bool] = []

        def other() -> None:  # a thread on its own stream: copies and events run as usual
            seen.append(torch.cuda.is_current_stream_capturing())
            with torch.cuda.stream(copy):
                torch.ones(4).pin_memory().to("cuda", non_blocking=True)
                torch.cuda.Event().record()  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()  # forbidden in global mode only

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert seen == [False]
        assert sim.kinds() == ({Kind.CAPTURE} if mode == "global" else set())
        sim.hazards.clear()
        capture.query()  # never allowed on the capturing stream
        assert sim.kinds() == {Kind.CAPTURE}
        sim.hazards.clear()
        copy.wait_stream(capture)  # a nostall stream joins the capture
        assert sim.kinds() == {Kind.CAPTURE}
        sim.hazards.clear()
    assert not torch.cuda.is_current_stream_capturing()
    graph.replay()
    assert y.device.type == "cuda"
    assert sim.hazards == []
