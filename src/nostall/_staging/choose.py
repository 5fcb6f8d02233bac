"""Staging, the stage between the source and the hand-off: which staging a device gets.

Each batch is staged by the producer thread (or the consumer's, when it pulls a batch itself),
in four ordered steps on CUDA::

    pin -> copy -> transform (and its checkpoint) -> ready event

and handed out in the consumer thread. The steps every device shares, and the devices that
need no streams, are in :mod:`nostall._staging.base`; CUDA's streams, events and pinning in
:mod:`nostall._staging.cuda`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import ConsumerThreadStaging, Staging
from .cuda import CudaStaging


def staging_for(device: torch.device, pin: bool, transform: Callable[[Any], Any] | None) -> Staging:
    """The staging of a prefetcher to ``device``.

    Streams on CUDA, the consumer's thread on MPS, the producer thread elsewhere.
    """
    if device.type == "cuda":
        return CudaStaging(device, pin, transform)
    if device.type == "mps":
        return ConsumerThreadStaging(device, transform)
    return Staging(device, transform)
