"""``collate_uint8``: stack uint8 images into one uint8 batch, with no float on the CPU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

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
                f"collate_uint8: {where} is a {type(image).__name__}; it takes uint8 tensors or "
                f"NumPy arrays"
            ) from e
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


def _stack(images: Sequence[Any]) -> torch.Tensor:
    views = [_as_chw(image, f"image {i}") for i, image in enumerate(images)]
    shape = views[0].shape
    for i, view in enumerate(views):
        if view.shape != shape:
            raise ValueError(
                f"collate_uint8: image {i} is {tuple(view.shape)} (C, H, W) but image 0 is "
                f"{tuple(shape)}; resize or crop to one size in the dataset"
            )
    out = torch.empty((len(views), *shape), dtype=torch.uint8)
    for i, view in enumerate(views):
        out[i].copy_(view)  # one pass per image: layout change and stacking together
    return out


def _is_image(value: Any) -> bool:
    """A uint8 tensor or NumPy array with 2 or 3 dimensions."""
    dtype = getattr(value, "dtype", None)
    return (dtype is torch.uint8 or str(dtype) == "uint8") and getattr(value, "ndim", 0) in (2, 3)


def collate_uint8(samples: Sequence[Any]) -> Any:
    """Collate samples whose images are uint8, keeping them uint8, as (N, C, H, W).

    A sample is an image, a tuple or list whose uint8 entries are images (``(image, label)``),
    or a mapping whose uint8 values are images. Images may be tensors (CHW, or HWC) or NumPy
    arrays (HWC, as PIL and OpenCV give them, or HW). Everything else is collated by PyTorch's
    ``default_collate``. Use it as ``DataLoader(..., collate_fn=nostall.collate_uint8)``.

    Raises:
        TypeError: an image is not uint8 (the message says where to convert instead).
        ValueError: the images differ in shape.
    """
    if not samples:
        raise ValueError("collate_uint8 got no samples")
    first = samples[0]
    if _is_image(first):
        return _stack(samples)
    if isinstance(first, Mapping):
        return type(first)(
            {  # type: ignore[call-arg]
                key: _stack([s[key] for s in samples])
                if _is_image(first[key])
                else default_collate([s[key] for s in samples])
                for key in first
            }
        )
    if isinstance(first, (tuple, list)):
        columns = list(zip(*samples, strict=True))
        out = [_stack(col) if _is_image(col[0]) else default_collate(list(col)) for col in columns]
        return type(first)(out) if not hasattr(first, "_fields") else type(first)(*out)
    return default_collate(list(samples))
