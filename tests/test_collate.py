"""collate_uint8: uint8 images stacked as (N, C, H, W) uint8, never as float."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from helpers import as_dataset
from torch.utils.data import DataLoader

import nostall


def test_numpy_hwc_images_become_nchw_uint8() -> None:
    """PIL-style HWC arrays: channels moved first, values exact."""
    arrays = [
        np.random.default_rng(i).integers(0, 256, (5, 6, 3), dtype=np.uint8) for i in range(4)
    ]
    out = nostall.collate_uint8(arrays)
    assert torch.uint8 == out.dtype
    assert (4, 3, 5, 6) == tuple(out.shape)
    for i, a in enumerate(arrays):
        assert np.array_equal(a.transpose(2, 0, 1), out[i].numpy())


def test_hwc_images_are_stacked_as_they_are_and_come_out_channels_last() -> None:
    """No transposing pass: an (N, C, H, W) view whose memory is the HWC images in a row."""
    arrays = [
        np.random.default_rng(i).integers(0, 256, (5, 6, 3), dtype=np.uint8) for i in range(3)
    ]
    out = nostall.collate_uint8(arrays)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(np.stack(arrays), out.permute(0, 2, 3, 1).numpy())
    hwc_tensors = [torch.from_numpy(a) for a in arrays]  # HWC given as tensors: the same
    assert torch.equal(out, nostall.collate_uint8(hwc_tensors))


def test_flipped_and_sliced_arrays() -> None:
    """Negative strides (np.fliplr) and strided slices are taken, values exact."""
    base = np.random.default_rng(0).integers(0, 256, (6, 8, 3), dtype=np.uint8)
    images = [np.fliplr(base), base[::2, 1:7]]
    out = nostall.collate_uint8([images[0], np.fliplr(base)])
    assert np.array_equal(np.fliplr(base).transpose(2, 0, 1), out[0].numpy())
    sliced = nostall.collate_uint8([images[1], images[1]])
    assert np.array_equal(images[1].transpose(2, 0, 1), sliced[1].numpy())


def _collate_reporting_shared(samples: Sequence[object]) -> tuple[object, bool]:
    out = nostall.collate_uint8(samples)
    return out, out[0].is_shared()


def test_in_a_worker_the_batch_is_built_in_shared_memory() -> None:
    """Like default_collate: sending the batch to the main process copies nothing more."""
    data = [(np.full((4, 4, 3), i, dtype=np.uint8), i) for i in range(4)]
    loader = DataLoader(
        as_dataset(data), batch_size=2, num_workers=1, collate_fn=_collate_reporting_shared
    )
    assert [True, True] == [shared for _, shared in loader]
    main = _collate_reporting_shared(data)
    assert not main[1]


def test_chw_tensors_and_grayscale() -> None:
    """CHW tensors are stacked as they are; 2-D grayscale gets a channel."""
    chw = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    assert torch.equal(torch.stack(chw), nostall.collate_uint8(chw))
    gray = [np.zeros((4, 5), dtype=np.uint8)] * 2
    assert (2, 1, 4, 5) == tuple(nostall.collate_uint8(gray).shape)


def test_tuples_and_dicts_keep_labels_collated_as_usual() -> None:
    """(image, label) and {"image", "label"} samples: images uint8, the rest default_collate."""
    samples = [(np.zeros((4, 4, 3), dtype=np.uint8), i) for i in range(5)]
    images, labels = nostall.collate_uint8(samples)
    assert (5, 3, 4, 4) == tuple(images.shape)
    assert torch.equal(torch.arange(5), labels)
    dicts = [{"image": torch.zeros(3, 2, 2, dtype=torch.uint8), "label": 1.5}] * 2
    out = nostall.collate_uint8(dicts)
    assert torch.uint8 == out["image"].dtype
    assert torch.equal(torch.tensor([1.5, 1.5], dtype=torch.float64), out["label"])


def test_in_a_dataloader() -> None:
    """As collate_fn of a DataLoader with workers."""
    data = [(np.full((8, 8, 3), i, dtype=np.uint8), i) for i in range(10)]
    loader = DataLoader(
        as_dataset(data), batch_size=4, num_workers=2, collate_fn=nostall.collate_uint8
    )
    batches = list(loader)
    assert [4, 4, 2] == [len(b[0]) for b in batches]
    assert torch.uint8 == batches[0][0].dtype
    assert 9 == int(batches[-1][0][-1, 0, 0, 0])


def test_mismatched_shapes_name_the_image() -> None:
    """A clear error naming the odd image: the sample, and the entry within it."""
    small, large = torch.zeros(3, 4, 4, dtype=torch.uint8), torch.zeros(3, 5, 5, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"sample 1 is \(3, 5, 5\) \(C, H, W\) but sample 0 is"):
        nostall.collate_uint8([small, large])
    with pytest.raises(ValueError, match=r"sample 1\[0\] is \(3, 5, 5\)"):
        nostall.collate_uint8([(small, 0), (large, 1)])
    with pytest.raises(ValueError, match=r"sample 1\['image'\] is \(3, 5, 5\)"):
        nostall.collate_uint8([{"image": small}, {"image": large}])


def test_float_image_at_the_top_is_refused() -> None:
    """Float images are not silently stacked as uint8: say where to convert instead."""
    with pytest.raises(TypeError, match=r"sample 1 has dtype torch\.float32.*Normalize or ToDtype"):
        nostall.collate_uint8([torch.zeros(3, 2, 2, dtype=torch.uint8), torch.zeros(3, 2, 2)])


def test_an_image_entry_that_changes_kind_is_refused() -> None:
    """Whether an entry is an image follows the first sample; a later misfit is named."""
    image = np.zeros((4, 5, 3), np.uint8)
    with pytest.raises(TypeError, match=r"sample 2\[0\] has dtype torch\.float32"):
        nostall.collate_uint8([(image, 0), (image, 1), (image.astype(np.float32), 2)])
    with pytest.raises(ValueError, match=r"sample 1\['image'\] has shape \(2, 4, 5, 3\)"):
        nostall.collate_uint8([{"image": image}, {"image": np.stack([image, image])}])


@pytest.mark.parametrize(
    "sample",
    [
        np.zeros((4, 5, 3), np.float32),  # a float image
        torch.zeros(3, 4, 5),
        np.zeros((4, 5), np.int64),  # a mask on its own
        torch.zeros(2, 3, 4, 5, dtype=torch.uint8),  # 4-D
    ],
    ids=["float array", "float tensor", "int64 array", "4-D uint8"],
)
def test_samples_that_are_not_uint8_images_are_refused(sample: Any) -> None:
    """Stacked as given they would silently differ in layout from what uint8 images give."""
    fix = "return it in a tuple" if sample.dtype in (np.uint8, torch.uint8) else "default_collate"
    with pytest.raises(TypeError, match=f"it stacks uint8 images.*{fix}"):
        nostall.collate_uint8([sample, sample])


def test_other_entries_are_stacked_as_given_and_documented() -> None:
    """In a tuple only 2-D/3-D uint8 entries are images; masks and clips are default-collated."""
    image = np.zeros((4, 5, 3), np.uint8)
    mask = np.ones((4, 5), np.int64)
    clip = torch.zeros(2, 3, 4, 5, dtype=torch.uint8)
    features = np.zeros((4, 5, 3), np.float32)
    images, masks, clips, feats = nostall.collate_uint8([(image, mask, clip, features)] * 2)
    assert images.shape == (2, 3, 4, 5)
    assert images.dtype == torch.uint8
    assert masks.shape == (2, 4, 5)
    assert masks.dtype == torch.int64
    assert clips.shape == (2, 2, 3, 4, 5)
    assert feats.shape == (2, 4, 5, 3)  # float: as given, not an image


@pytest.mark.parametrize(
    ("samples", "message"),
    [
        ([(np.zeros((2, 2), np.uint8), 1), (np.zeros((2, 2), np.uint8),)], "sample 1 has 1"),
        ([{"image": np.zeros((2, 2), np.uint8)}, {"img": np.zeros((2, 2), np.uint8)}], "keys"),
    ],
    ids=["ragged tuples", "different keys"],
)
def test_samples_of_different_structure_are_named(samples: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nostall.collate_uint8(samples)
    with pytest.raises(TypeError, match="sample 1 is an int but sample 0 is a"):
        nostall.collate_uint8([samples[0], 3])


def test_no_samples() -> None:
    """An empty list is an error, not an empty tensor of unknown shape."""
    with pytest.raises(ValueError, match="no samples"):
        nostall.collate_uint8([])


@pytest.mark.cuda
def test_cuda_channels_last_batches_cross_as_they_are() -> None:
    """A channels-last uint8 batch is pinned and copied with its strides; values exact."""
    data = [
        (np.random.default_rng(i).integers(0, 256, (6, 5, 3), dtype=np.uint8), i) for i in range(8)
    ]
    loader = DataLoader(as_dataset(data), batch_size=4, collate_fn=nostall.collate_uint8)
    for (expected, _), (got, labels) in zip(loader, nostall.prefetch(loader, "cuda"), strict=True):
        assert got.is_cuda
        assert labels.is_cuda
        assert got.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(expected, got.cpu())


def test_read_only_arrays_are_stacked_without_a_warning() -> None:
    """``np.asarray(pil_image)`` is read-only: stacking it must not warn (warnings are errors)."""
    images = []
    for i in range(3):
        a = np.full((4, 5, 3), i, dtype=np.uint8)
        a.setflags(write=False)
        images.append(a)
    batch = nostall.collate_uint8([(img, i) for i, img in enumerate(images)])
    assert (3, 3, 4, 5) == tuple(batch[0].shape)
    assert [0, 1, 2] == batch[0][:, 0, 0, 0].tolist()
    assert torch.equal(torch.tensor([0, 1, 2]), batch[1])
