"""ResizedCenterCrop: the evaluation pipeline's resize then centre crop, on a batch or a list."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import _arguments as check
from ._base import Key, TakesImages, Transform, check_batch, max_value


class ResizedCenterCrop(TakesImages, Transform):
    """Resize each image so that its shorter side is ``resize``, then crop its centre to ``size``.

    torchvision's ``Resize(resize)`` then ``CenterCrop(size)``, the usual evaluation pipeline:
    the longer side becomes ``int(resize * long / short)``, the crop's corner
    ``round((side - size) / 2)``, and an image smaller than the crop is padded with zeros.
    ``resize`` defaults to ``size * 256 / 224`` (256 for 224), ImageNet's evaluation ratio.
    With ``antialias=True`` (the default, as torchvision's) a shrink is low-pass filtered as
    PIL's bilinear resize is. The images are a batch (N, C, H, W), or a list of (C, H, W)
    images of any sizes (as :class:`DecodeJPEG` gives them). The output is float (``dtype``)
    in [0, 1] for integer images, as :class:`RandomResizedCrop`'s; nothing is drawn.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        resize: int | None = None,
        dtype: torch.dtype = torch.float32,
        antialias: bool = True,
        on: Key | None = 0,
    ) -> None:
        super().__init__(on)
        self.size = check.size("ResizedCenterCrop", "size", size)
        if resize is None:
            resize = round(min(self.size) * 256 / 224)
        if isinstance(resize, bool) or not isinstance(resize, int) or resize < 1:
            raise ValueError(
                f"ResizedCenterCrop(resize=...) is the shorter side after resizing, an int >= 1 "
                f"(got {resize!r}); pass e.g. resize=256 with size=224"
            )
        self.resize = resize
        self.dtype = check.dtype("ResizedCenterCrop", "dtype", dtype, floating=True)
        check.flag("ResizedCenterCrop", "antialias", antialias)
        self.antialias = antialias

    def apply(self, images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Output (N, C, *size) in ``dtype``; a batch of one size is resized in one call."""
        if isinstance(images, torch.Tensor):
            check_batch("ResizedCenterCrop", images)
            return self._one_size(images)
        first = images[0]
        out = torch.empty(
            len(images), first.shape[0], *self.size, dtype=self.dtype, device=first.device
        )
        for i, image in enumerate(images):
            if image.dim() != 3 or image.shape[0] != first.shape[0]:
                raise ValueError(
                    f"ResizedCenterCrop takes a list of (C, H, W) images with the same C; item "
                    f"{i} has shape {tuple(image.shape)}, item 0 {tuple(first.shape)}"
                )
            out[i] = self._one_size(image[None])[0]
        return out

    def _one_size(self, images: torch.Tensor) -> torch.Tensor:
        height, width = images.shape[-2:]
        short, long = min(height, width), max(height, width)
        resized_long = int(self.resize * long / short)
        target = (self.resize, resized_long) if height <= width else (resized_long, self.resize)
        work = torch.promote_types(self.dtype, torch.float32)
        source = images.to(work)
        if not images.is_floating_point():
            source.mul_(1.0 / max_value(images.dtype))
        resized = F.interpolate(
            source, size=target, mode="bilinear", align_corners=False, antialias=self.antialias
        )
        crop_h, crop_w = self.size
        pad_h, pad_w = max(0, crop_h - target[0]), max(0, crop_w - target[1])
        if pad_h or pad_w:  # as torchvision's CenterCrop: zeros around an image too small
            resized = F.pad(resized, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        top = round((resized.shape[-2] - crop_h) / 2.0)
        left = round((resized.shape[-1] - crop_w) / 2.0)
        return resized[..., top : top + crop_h, left : left + crop_w].to(self.dtype)

    def __repr__(self) -> str:
        return f"ResizedCenterCrop({self.size}, resize={self.resize}, on={self.on!r})"
