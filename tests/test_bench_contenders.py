"""Every contender feeds the same batches, in the same order, as the serial loader."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_batches
from torch.utils.data import DataLoader

from nostall.bench import _contenders as c
from nostall.bench._workload import SyntheticImages

CPU = torch.device("cpu")


@pytest.fixture
def sources() -> c.Sources:
    data = SyntheticImages(40, image_size=8)
    return c.Sources(
        serial=DataLoader(data, batch_size=6),
        workers=DataLoader(data, batch_size=6, num_workers=2, persistent_workers=True),
    )


@pytest.mark.parametrize("contender", [k for k in c.ALL if k.available(CPU)], ids=lambda k: k.name)
def test_contender_yields_the_loaders_batches_every_epoch(
    contender: c.Contender, sources: c.Sources
) -> None:
    """Two epochs of each contender equal the plain loader's batches."""
    expected = list(sources.serial)
    loop = contender.make(sources, CPU, 2)
    for _ in range(2):
        assert_same_batches(expected, loop)
    close = getattr(loop, "close", None)
    if callable(close):
        close()


def test_peers_are_installed_for_the_suite() -> None:
    """make installs the peers extra, so the peer contenders run here."""
    assert c.PREFETCH_GENERATOR.available(CPU)
    assert c.TORCHDATA.available(CPU)


def test_gpu_only_contender_is_skipped_on_cpu() -> None:
    """The timm-style lookahead needs CUDA."""
    assert not c.LOOKAHEAD.available(CPU)


def test_missing_peer_is_not_available() -> None:
    """A peer whose module is absent is skipped, not an error."""
    ghost = c.Contender("ghost", "serial", c.SERIAL.make, requires="no_such_module_nostall")
    assert not ghost.available(CPU)


def test_with_depth_names_and_passes_the_depth(sources: c.Sources) -> None:
    """The depth sweep's contenders carry their depth."""
    deep = c.with_depth(c.NOSTALL, 5)
    assert "nostall (depth 5)" == deep.name
    assert 5 == deep.make(sources, CPU, 2).depth  # type: ignore[attr-defined]
