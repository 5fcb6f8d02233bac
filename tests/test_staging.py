"""Which staging a device gets: streams on CUDA, the consumer's thread on MPS."""

from __future__ import annotations

import torch
from simcuda import simulated_cuda

from nostall._staging.base import ConsumerThreadStaging, Staging
from nostall._staging.choose import staging_for
from nostall._staging.cuda import CudaStaging


def test_mps_stages_in_the_consumers_thread() -> None:
    """A second thread's MPS work can abort inside Metal: MPS batches move where the model runs."""
    assert isinstance(staging_for(torch.device("mps"), False, None), ConsumerThreadStaging)
    assert type(staging_for(torch.device("cpu"), False, None)) is Staging


def test_cuda_stages_on_streams() -> None:
    """On CUDA a batch is copied on a side stream the consumer's stream waits for."""
    with simulated_cuda():
        assert isinstance(staging_for(torch.device("cuda"), True, None), CudaStaging)
