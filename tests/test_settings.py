"""The prefetcher's settings: one frozen value, checked once against the source."""

from __future__ import annotations

import dataclasses

import pytest

import nostall
from nostall._engine.settings import Settings


def test_a_prefetcher_keeps_its_settings_as_one_frozen_value() -> None:
    """What was passed, once; read by the prefetcher's depth and across_epochs."""
    p = nostall.prefetch([1, 2], "cpu", depth=3, across_epochs=True, timeout=9.0)
    settings = p._settings
    assert Settings("cpu", depth=3, across_epochs=True, timeout=9.0) == settings
    assert 3 == p.depth
    assert p.across_epochs
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.depth = 4  # type: ignore[misc]


def test_settings_are_checked_against_the_source() -> None:
    """A wrong value is refused when the settings are made, naming the argument."""
    with pytest.raises(ValueError, match="depth"):
        Settings.checked([1], depth=0)
    with pytest.raises(TypeError, match="transform must be callable"):
        Settings.checked([1], transform=3)
