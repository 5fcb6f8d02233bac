"""Every contender feeds the same batches, in the same order, as the serial loader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_same_batches, wait_for_no_nostall_threads
from torch.utils.data import DataLoader

from nostall.bench import _contenders as c
from nostall.bench._workloads import JpegImages, SyntheticImages, jpeg_files

CPU = torch.device("cpu")


@pytest.fixture
def sources() -> c.Sources:
    data = SyntheticImages(40, size=8)
    return c.Sources(
        DataLoader(data, batch_size=6),
        DataLoader(data, batch_size=6, num_workers=2, persistent_workers=True),
    )


@pytest.mark.parametrize(
    "contender", [k for k in c.chosen((), CPU, c.ALL) if k is not c.DECODE], ids=lambda k: k.name
)
def test_contender_yields_the_loaders_batches_every_epoch(
    contender: c.Contender, sources: c.Sources
) -> None:
    """Two epochs of each contender equal the plain loader's batches."""
    expected = list(sources.serial)
    loop = contender.make(sources, CPU, 3)
    for _ in range(2):
        assert_same_batches(expected, loop)
    if callable(close := getattr(loop, "close", None)):
        close()
    assert [] == wait_for_no_nostall_threads()


def test_the_decode_on_the_device_reads_the_trials_files(tmp_path: Path) -> None:
    """Over a JpegImages: its files' bytes, decoded and augmented to its size, its labels."""
    paths = jpeg_files(str(tmp_path), 5)
    data = JpegImages(paths, 24, length=7)  # past the files: cycled, as the trial's
    sources = c.Sources(DataLoader(data, batch_size=3), DataLoader(data, batch_size=3))
    loop = c.DECODE.make(sources, CPU, 2)
    for _ in range(2):
        batches = list(loop)
        assert [b[1].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
        assert [tuple(b[0].shape) for b in batches] == [(3, 3, 24, 24)] * 2 + [(1, 3, 24, 24)]
        assert all(b[0].dtype == torch.float32 for b in batches)
    loop.close()  # type: ignore[attr-defined]
    assert [] == wait_for_no_nostall_threads()


def test_peers_are_installed_for_the_suite() -> None:
    """make installs the peers extra, so in its environment the peer contenders run.

    Elsewhere (``make gpu-check`` with a machine's own interpreter, nothing installed) a peer
    may be missing: the bench then leaves it out, and this says which.
    """
    missing = [p.requires for p in (c.PREFETCH_GENERATOR, c.TORCHDATA) if not p.available(CPU)]
    stamp = Path(sys.prefix) / ".nostall-installed"  # the Makefile's, in the venv it made
    if missing and not stamp.exists():
        pytest.skip(
            f"peers not installed here: {', '.join(map(str, missing))} (this interpreter's "
            f"environment was not made by make, which installs the peers extra)"
        )
    assert [] == missing


def test_gpu_only_and_missing_contenders_are_left_out() -> None:
    """The timm-style lookahead needs CUDA; a peer whose module is absent is skipped."""
    ghost = c.Contender("ghost", c.SERIAL.make, requires="no_such_module_nostall")
    assert not c.LOOKAHEAD.available(CPU)
    assert not ghost.available(CPU)
    assert c.LOOKAHEAD not in c.chosen((), CPU)


def test_chosen_keeps_the_registry_order_and_the_names_asked_for() -> None:
    """Only the names asked for, in the order tables list them."""
    assert [c.SERIAL, c.NOSTALL] == c.chosen(("nostall", "serial DataLoader"), CPU)


def test_nostall_contenders_use_the_depth_given(sources: c.Sources) -> None:
    """The bench's --depth reaches nostall."""
    assert 5 == c.NOSTALL.make(sources, CPU, 5).depth  # type: ignore[attr-defined]
