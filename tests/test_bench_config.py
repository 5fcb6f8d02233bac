"""The benchmark's settings, checked before anything runs."""

from __future__ import annotations

import pytest

from nostall.bench import BenchConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("batches", 0),
        ("ratios", ()),
        ("ratios", (0.0,)),
        ("depths", (0,)),
        ("io_share", 1.5),
        ("contenders", ("nobody",)),
    ],
)
def test_bad_config(field: str, value: object) -> None:
    """Bad settings fail before anything runs, naming the setting."""
    with pytest.raises(ValueError, match=field.rstrip("s") if field != "io_share" else "io_share"):
        BenchConfig(**{field: value})  # type: ignore[arg-type]
