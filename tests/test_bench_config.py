"""The bench's settings: every field is a flag, and values are checked before anything runs."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from nostall.bench import BenchConfig
from nostall.bench._config import add_flags, from_flags


def parser() -> argparse.ArgumentParser:
    out = argparse.ArgumentParser()
    add_flags(out)
    return out


def test_every_field_is_a_flag_with_its_help_and_default() -> None:
    """A field is its flag: --io-share for io_share, documented, defaulting to the field's."""
    text = parser().format_help()
    for f in dataclasses.fields(BenchConfig):
        assert "--" + f.name.replace("_", "-") in text
        assert f.metadata["help"].split()[0] in text
    assert BenchConfig() == from_flags(parser().parse_args([]))


def test_flags_become_the_config() -> None:
    """Lists, numbers and names arrive typed."""
    args = parser().parse_args(
        ["--ratios", "0.5,2", "--repeats", "5", "--contenders", "nostall,serial DataLoader"]
    )
    config = from_flags(args)
    assert (0.5, 2.0) == config.ratios
    assert 5 == config.repeats
    assert ("nostall", "serial DataLoader") == config.contenders


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"batches": 0}, "batches=0 is not valid: must be >= 1"),
        ({"batches": True}, "batches=True is not valid"),
        ({"repeats": 1.5}, "repeats=1.5 is not valid"),
        ({"ratios": ()}, "ratios=() is not valid"),
        ({"ratios": (1.0, -1.0)}, "ratios=(1.0, -1.0) is not valid: must be > 0 (got -1.0)"),
        ({"io_share": 2.0}, "io_share must be between 0 and 1"),
        ({"contenders": ("nope",)}, "unknown contenders ['nope']; choose from"),
        ({"min_run_time": 0.0}, "min_run_time=0.0 is not valid"),
    ],
)
def test_bad_values_are_refused_naming_the_field(change: dict[str, object], message: str) -> None:
    """Each refusal names the field, what it got, and what it should be."""
    with pytest.raises(ValueError, match=re.escape(message)):
        BenchConfig(**change)  # type: ignore[arg-type]


def test_no_jpeg_workload_and_unset_counts_are_allowed() -> None:
    """jpeg_images=0 skips the JPEG trial; workers and compute threads default to None."""
    config = BenchConfig(jpeg_images=0, workers=None, compute_threads=None)
    assert 0 == config.jpeg_images
