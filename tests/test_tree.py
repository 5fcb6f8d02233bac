"""``nostall.cuda._tree``: the order tensors are found in, and the batch size read from it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import nostall
from nostall.cuda._tree import batch_size_of, iter_tensors, map_tensors


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor


class Holder:
    def __init__(self) -> None:
        self.first = torch.zeros(1)
        self.second = torch.zeros(2)


def test_tensors_come_in_reading_order() -> None:
    """Depth first, left to right: the images of (images, labels) come first."""
    a, b, c, d, e, f, g = (torch.zeros(i + 1) for i in range(7))
    batch = ({"x": a, "y": [b, c]}, Sample(d, e), (f,), g)
    assert [t.numel() for t in iter_tensors(batch)] == [1, 2, 3, 4, 5, 6, 7]
    assert [t.numel() for t in iter_tensors(Holder())] == [1, 2]


def test_batch_size_is_the_first_dimension_of_the_first_tensor() -> None:
    images, labels = torch.zeros(8, 3, 4, 4), torch.zeros(8, dtype=torch.int64)
    assert batch_size_of((images, labels)) == 8
    assert batch_size_of({"label": torch.zeros(5), "image": torch.zeros(9, 3)}) == 5
    assert batch_size_of([torch.tensor(1.0), images]) is None  # a scalar first: not a batch
    assert batch_size_of({"name": "x"}) is None


class Slotted:
    __slots__ = ("image", "label")

    def __init__(self) -> None:
        self.image = torch.zeros(3)
        self.label = torch.zeros(1)


def test_tensors_of_slotted_objects_are_found() -> None:
    """A slotted batch object keeps no __dict__; its tensors are found all the same."""
    assert [t.numel() for t in iter_tensors([Slotted()])] == [3, 1]


def nested(depth: int) -> Any:
    """A tensor inside ``depth`` lists, each holding the next."""
    batch: Any = torch.zeros(1)
    for _ in range(depth):
        batch = [batch]
    return batch


def test_a_batch_nested_too_deep_to_walk_is_a_value_error_naming_its_depth() -> None:
    """A list nested 5000 deep: a ValueError naming the depth, not a RecursionError."""
    with pytest.raises(ValueError, match="this batch nests containers 5000 levels deep"):
        map_tensors(nested(5000), lambda t: t)
    batches = nostall.prefetch([nested(5000)], "cpu")
    with pytest.raises(ValueError, match="5000 levels deep") as info:
        next(iter(batches))
    assert "Flatten it" in str(info.value)
