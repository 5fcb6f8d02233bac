"""The benchmark's workload: synthetic images in either layout, and the CPU-side pipeline."""

from __future__ import annotations

import pytest
import torch

from nostall.bench._workload import NormalizedOnCpu, SyntheticImages

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def test_layouts_hold_the_same_pixels() -> None:
    """Either layout holds one item's values in the same memory order; pixels vary in it."""
    chw, hwc = SyntheticImages(5, image_size=6), SyntheticImages(5, image_size=6, layout="hwc")
    for i in range(5):
        a, label = chw[i]
        b, same_label = hwc[i]
        assert (3, 6, 6) == tuple(a.shape)
        assert torch.equal(a.flatten(), b.flatten())  # the same values in memory order
        assert label == same_label
        assert len(a.unique()) > 1
    assert not torch.equal(chw[0][0], chw[1][0])


def test_cpu_side_normalising_is_totensor_then_normalize() -> None:
    """HWC images become (C, H, W) floats: (x / 255 - mean) / std per channel."""
    hwc = SyntheticImages(3, image_size=4, layout="hwc")
    image, _ = hwc[2]
    out, _ = NormalizedOnCpu(hwc, MEAN, STD)[2]
    expected = (image.permute(2, 0, 1).double() / 255 - torch.tensor(MEAN).view(3, 1, 1)) / (
        torch.tensor(STD).view(3, 1, 1)
    )
    assert out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


def test_unknown_layout_is_refused() -> None:
    """A clear error naming the two layouts."""
    with pytest.raises(ValueError, match="layout must be"):
        SyntheticImages(1, layout="nhwc")
