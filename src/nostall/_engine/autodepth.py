"""How many batches may be in flight: the one memory-budget rule.

``depth="auto"`` starts at 1 and doubles while the consumer waits; :func:`auto_depth_limit`
bounds it once the first batch shows its size. The tuner bounds the depths it tries by the same
rule, so it never recommends a depth that auto would not allow.

Invariant: at most :data:`MAX_DEPTH` batches, and never more than :data:`MEMORY_SHARE` of the
device's available memory (measured when the first batch arrives) in batches in flight.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cuda._devices import available_memory
from ..cuda._tree import iter_tensors

#: ``depth="auto"`` never grows beyond this many batches.
MAX_DEPTH = 64
#: ... nor beyond what this share of the device's available memory holds.
MEMORY_SHARE = 0.1


def most_in_flight(depth: int | str) -> int:
    """The most batches a prefetcher of ``depth`` (an int, or ``"auto"``) holds in flight."""
    return MAX_DEPTH if depth == "auto" else int(depth)


def batch_nbytes(batch: Any) -> int:
    """Bytes of every tensor in ``batch`` (nested containers and objects included)."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(batch))


def depth_budget(nbytes: int, device: torch.device) -> int:
    """The most batches of ``nbytes`` each that the budget allows on ``device`` (>= 1)."""
    if nbytes <= 0:  # nothing to weigh: the cap alone bounds it
        return MAX_DEPTH
    budget = MEMORY_SHARE * available_memory(device)
    return max(1, min(MAX_DEPTH, int(budget // nbytes)))


def auto_depth_limit(batch: Any, device: torch.device) -> int:
    """How deep ``depth="auto"`` may grow, once the first staged ``batch`` shows its size."""
    return depth_budget(batch_nbytes(batch), device)
