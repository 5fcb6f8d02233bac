"""Timing helpers that are right under asynchronous device execution."""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait until all work queued on ``device`` has finished (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
