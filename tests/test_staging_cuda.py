"""CUDA staging, driven directly: pin -> copy on the copy stream -> transform -> ready event.

The CUDA path's stream safety end to end, with canaries, is in test_transfer_simulated.py; here,
the steps of one batch, on the simulated CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import CountingTransform
from simcuda import Simulation, simulated_cuda

from nostall._staging_cuda import CudaStaging


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
