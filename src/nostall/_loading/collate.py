"""``collate_uint8``: stack uint8 images into one uint8 batch, with no float on the CPU.

Invariants:
    * Every image batch is (N, C, H, W) uint8 with exactly the input's values.
    * Channels-last input (NumPy HWC arrays as PIL and OpenCV give them, HWC tensors) is
      stacked byte for byte and returned as a channels-last (N, C, H, W) view: transposing
      every byte on the CPU would cost a loader worker more than the stacking itself, and GPU
      convolutions prefer channels-last. ``.contiguous()`` on the device gives plain NCHW.
    * In a DataLoader worker the batch is written straight into shared memory (as
      ``default_collate`` does), so sending it to the main process copies nothing more.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate, get_worker_info

from .._arguments import kind
from .._torch_compat import empty_shared_uint8

_CHANNELS = (1, 3, 4)


def _as_chw(image: Any, where: str) -> torch.Tensor:
    """A uint8 (C, H, W) view of a tensor or NumPy array given as HWC, CHW or HW."""
    if isinstance(image, torch.Tensor):
        tensor, channels_last = image, False
    else:
        try:
            tensor = torch.from_numpy(image)
        except TypeError as e:
            raise TypeError(
                f"collate_uint8: {where} is {kind(image)}; it takes uint8 tensors or NumPy arrays"
            ) from e
        except ValueError:  # negative strides (a flipped view): torch cannot view them
            tensor = torch.from_numpy(image.copy())
        channels_last = True  # NumPy images (PIL, OpenCV) are height, width, channels
    if tensor.dtype != torch.uint8:
        raise TypeError(
            f"collate_uint8: {where} has dtype {tensor.dtype}; it stacks uint8 images (convert "
            f"to float on the device with nostall.transforms.Normalize or ToDtype instead)"
        )
    if tensor.dim() == 2:
        return tensor.unsqueeze(0)
    if tensor.dim() != 3:
        raise ValueError(
            f"collate_uint8: {where} has shape {tuple(tensor.shape)}; images are "
            f"(H, W), (H, W, C) or (C, H, W)"
        )
    if channels_last and tensor.shape[-1] in _CHANNELS:
        return tensor.permute(2, 0, 1)
    if not channels_last and tensor.shape[0] not in _CHANNELS and tensor.shape[-1] in _CHANNELS:
        return tensor.permute(2, 0, 1)  # a tensor given as HWC
    return tensor


def _stack(images: Sequence[Any], entry: str = "") -> torch.Tensor:
    """Stack one image per sample; ``entry`` says where in a sample errors point (``"[0]"``)."""
    if _all_hwc_arrays(images):
        return _stack_arrays(images)
    views = [_as_chw(image, f"sample {i}{entry}") for i, image in enumerate(images)]
    shape = views[0].shape
    for i, view in enumerate(views):
        if view.shape != shape:
            raise ValueError(
                f"collate_uint8: sample {i}{entry} is {tuple(view.shape)} (C, H, W) but sample "
                f"0{entry} is {tuple(shape)}; resize or crop to one size in the dataset"
            )
    if all(_channels_last(view) for view in views):
        hwc = [view.permute(1, 2, 0) for view in views]
        out = _empty((len(views), *hwc[0].shape))
        torch.stack(hwc, out=out)  # a plain copy per image
        return out.permute(0, 3, 1, 2)  # (N, C, H, W), channels-last in memory
    out = _empty((len(views), *shape))
    torch.stack(views, out=out)
    return out


def _all_hwc_arrays(images: Sequence[Any]) -> bool:
    """NumPy uint8 images of one HWC (or HW) shape: PIL's ``np.asarray(image)``, OpenCV's."""
    np = sys.modules.get("numpy")  # no NumPy imported: no arrays to stack
    first = images[0]
    if np is None or not (isinstance(first, np.ndarray) and str(first.dtype) == "uint8"):
        return False
    if not (first.ndim == 2 or (first.ndim == 3 and first.shape[-1] in _CHANNELS)):
        return False
    shape = first.shape
    return all(
        isinstance(a, np.ndarray) and str(a.dtype) == "uint8" and a.shape == shape for a in images
    )


def _stack_arrays(images: Sequence[Any]) -> torch.Tensor:
    """Stack HWC arrays byte for byte with NumPy, into a channels-last (N, C, H, W) view.

    Read-only arrays (``np.asarray`` of a PIL image is one) are only read here: no tensor is
    made from them, so torch has nothing to warn about, and nothing is copied twice.
    """
    import numpy as np

    first = images[0]
    hwc = first.shape if first.ndim == 3 else (*first.shape, 1)
    out = _empty((len(images), *hwc))
    np.stack([a.reshape(hwc) for a in images], out=out.numpy())
    return out.permute(0, 3, 1, 2)


def _channels_last(view: torch.Tensor) -> bool:
    """Whether a (C, H, W) view is a permuted contiguous (H, W, C) image."""
    c, h, w = view.stride()
    return c == 1 and w == view.shape[0] and h == view.shape[0] * view.shape[2] and c != w


def _empty(shape: tuple[int, ...]) -> torch.Tensor:
    """A uint8 tensor; in shared memory inside a DataLoader worker."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    return empty_shared_uint8(shape)


def _is_uint8(value: Any) -> bool:
    """A uint8 tensor or NumPy array."""
    dtype = getattr(value, "dtype", None)
    return dtype is torch.uint8 or str(dtype) == "uint8"


def _is_image(value: Any) -> bool:
    """A uint8 tensor or NumPy array with 2 or 3 dimensions."""
    return _is_uint8(value) and getattr(value, "ndim", 0) in (2, 3)


def collate_uint8(samples: Sequence[Any]) -> Any:
    """Collate samples whose images are uint8, keeping them uint8, as (N, C, H, W).

    A sample is an image, a tuple or list whose uint8 entries are images (``(image, label)``),
    or a mapping whose uint8 values are images. Images may be tensors (CHW, or HWC) or NumPy
    arrays (HWC, as PIL and OpenCV give them, or HW). Everything else is collated by PyTorch's
    ``default_collate``. Use it as ``DataLoader(..., collate_fn=nostall.collate_uint8)``.

    HWC images come out as a channels-last (N, C, H, W) view of their bytes, with no
    transposing pass on the CPU; ``nostall.transforms`` keep or set the layout on the device.

    What each kind of input becomes:

    * uint8 images, 2-D or 3-D, as samples or as entries of samples: one (N, C, H, W) uint8
      batch, values exact.
    * A sample that is itself a tensor or array but not a uint8 image (a float image, an int64
      array, a 4-D uint8 array): ``TypeError``. Stacked as given it would come out in another
      layout than images do (a float HWC array as (N, H, W, C)); the message says what to use.
    * Entries of tuples and mappings that are not uint8 images are stacked as given, by
      ``default_collate``: float arrays (an HWC float array stays (N, H, W, C)), int64 arrays
      (segmentation masks: (N, H, W)), 4-D uint8 entries (video clips: (N, T, ...)), labels.
      Whether an entry is an image is decided by the first sample's.
    * Samples that differ in structure are refused, naming the sample and the entry
      (``sample 3[0]``): see Raises.

    Raises:
        TypeError: an image entry is not uint8 in a later sample, a sample is a tensor or
            array that is not a uint8 image, or a sample is of another kind than the first
            (a tuple after a dict).
        ValueError: no samples, images of different shapes or not of 2 or 3 dimensions,
            tuples of different lengths (ragged), or mappings with different keys.
    """
    if not samples:
        raise ValueError("collate_uint8 got no samples; a DataLoader never calls it so")
    first = samples[0]
    if _is_image(first):
        return _stack(samples)
    if isinstance(first, torch.Tensor) or type(first).__module__ == "numpy":
        dtype, shape = getattr(first, "dtype", "?"), tuple(getattr(first, "shape", ()))
        fix = (
            "A uint8 array of another rank is not one image: return it in a tuple, e.g. "
            "(clip, label), to have it stacked as given, or use default_collate"
            if _is_uint8(first)
            else "Give the DataLoader collate_fn=None (default_collate) for these, or keep "
            "images uint8 until they are on the device"
        )
        raise TypeError(
            f"collate_uint8: the samples are {dtype} arrays of shape {shape}; it stacks uint8 "
            f"images of (H, W), (H, W, C) or (C, H, W). {fix}"
        )
    if isinstance(first, Mapping):
        _check_alike(samples, Mapping)
        keys = list(first)
        for i, sample in enumerate(samples):
            if list(sample) != keys and set(sample) != set(keys):
                raise ValueError(
                    f"collate_uint8: sample {i} has keys {sorted(map(str, sample))} but sample 0 "
                    f"has {sorted(map(str, keys))}; every sample needs the same keys"
                )
        return type(first)(
            {  # type: ignore[call-arg]
                key: _stack([s[key] for s in samples], f"[{key!r}]")
                if _is_image(first[key])
                else default_collate([s[key] for s in samples])
                for key in keys
            }
        )
    if isinstance(first, (tuple, list)):
        _check_alike(samples, (tuple, list))
        for i, sample in enumerate(samples):
            if len(sample) != len(first):
                raise ValueError(
                    f"collate_uint8: sample {i} has {len(sample)} entries but sample 0 has "
                    f"{len(first)}; every sample needs the same entries, e.g. (image, label)"
                )
        columns = list(zip(*samples, strict=True))
        out = [
            _stack(col, f"[{j}]") if _is_image(col[0]) else default_collate(list(col))
            for j, col in enumerate(columns)
        ]
        return type(first)(out) if not hasattr(first, "_fields") else type(first)(*out)
    return default_collate(list(samples))


def _check_alike(samples: Sequence[Any], expected: type | tuple[type, ...]) -> None:
    for i, sample in enumerate(samples):
        if not isinstance(sample, expected):
            raise TypeError(
                f"collate_uint8: sample {i} is {kind(sample)} but sample 0 is "
                f"{kind(samples[0])}; every sample must have the same structure"
            )
