"""The steps every device shares, driven directly: copy -> transform (and its checkpoint).

On the CPU in the producer thread; on MPS at hand-out, in the consumer's thread.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from helpers import CountingTransform

import nostall
from nostall import _prefetcher
from nostall._staging.base import ConsumerThreadStaging, Staging

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


class ThreadNotingTransform(CountingTransform):
    """A stateful transform that notes the thread it runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.current_thread().name)
        return super().__call__(batch)


def test_consumer_thread_staging_transforms_at_hand_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fetched ahead by the producer, transformed in the loop's thread.

    A state saved after a batch holds the transform's state right after that batch.
    """

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
