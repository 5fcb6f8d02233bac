"""The examples stay runnable."""

from __future__ import annotations

import math

from nostall._doctor import load_callable


def test_slow_loader_example_builds_and_steps() -> None:
    """The doctor's example: its factory takes the overrides, its step trains on a batch."""
    make_loader = load_callable("examples.slow_loader:make_loader", "factory")
    train_step = load_callable("examples.slow_loader:train_step", "--step")
    loader = make_loader(num_workers=0, pin_memory=False)
    images, labels = next(iter(loader))
    assert (32, 3, 32, 32) == tuple(images.shape)
    assert math.isfinite(train_step((images, labels)))
