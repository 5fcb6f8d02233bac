"""Random transforms, each with its own seeded generator: the flip and the crop."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import _arguments as check
from ..cuda._transfer import upload
from ._base import Key, TakesImages, Transform, check_batch, max_value, memory_format


class _Random(Transform):
    def __init__(self, seed: int, on: Key | None) -> None:
        super().__init__(on)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(
                f"{type(self).__name__}(seed=...) must be an int (got {seed!r}, a "
                f"{type(seed).__name__}); pass e.g. seed=0"
            )
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        """Start the random stream again from ``seed``."""
        self.generator.manual_seed(self.seed)

    def state_dict(self) -> dict[str, Any]:
        """The seed and where the generator is (a copy)."""
        return {**super().state_dict(), "seed": self.seed, "generator": self.generator.get_state()}

    def check_state(self, state: object) -> None:
        """Also the same seed, and a generator state."""
        super().check_state(state)
        assert isinstance(state, Mapping)
        if state.get("seed") != self.seed:
            raise ValueError(
                f"this {type(self).__name__} state was saved with seed={state.get('seed')!r}, "
                f"this one has seed={self.seed}; build it with the seed it was saved with"
            )
        generator = state.get("generator")
        if not isinstance(generator, torch.Tensor) or generator.dtype != torch.uint8:
            raise ValueError(
                f"this {type(self).__name__} state has no generator state (a uint8 tensor)"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the random draws from where ``state`` left them."""
        self.check_state(state)
        self.generator.set_state(state["generator"].clone())


class RandomHorizontalFlip(_Random):
    """Mirror each image left-right with probability ``p``."""

    def __init__(self, p: float = 0.5, *, seed: int = 0, on: Key | None = 0) -> None:
        super().__init__(seed, on)
        p = check.number("RandomHorizontalFlip", "p", p)
        if not 0.0 <= p <= 1.0:
            raise ValueError(
                f"RandomHorizontalFlip(p=...) is a probability, between 0 and 1 (got p={p}); "
                f"pass e.g. p=0.5"
            )
        self.p = p

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """One gather along the width: the output (in the input's layout) plus an (N, W) index."""
        check_batch("RandomHorizontalFlip", images)
        n, width = images.shape[0], images.shape[-1]
        flip = torch.rand(n, generator=self.generator) < self.p
        columns = torch.arange(width)
        index = upload(torch.where(flip[:, None], columns.flip(0), columns), images.device)
        # Written into an output shaped like the input, so a channels-last batch stays so.
        out = torch.empty_like(images)
        return torch.gather(images, -1, index.reshape(n, 1, 1, width).expand_as(images), out=out)


class RandomResizedCrop(TakesImages, _Random):
    """Crop a random area and aspect ratio of each image, resized to ``size`` (bilinear).

    The boxes follow the usual rule (area in ``scale`` of the image, aspect ratio log-uniform in
    ``ratio``, ten tries, then a centre crop), drawn per image. Sampling uses border-clamped
    bilinear interpolation with pixel centres aligned (``align_corners=False``), computed in at
    least float32 and rounded to ``dtype`` once. The output is float (``dtype``); integer images
    are scaled to [0, 1], the range :class:`Normalize` expects of float input.

    The images are a batch (N, C, H, W), or a list of (C, H, W) images of any sizes (as
    :class:`DecodeJPEG` gives them), which become one batch; a list of images of one size
    gives what their stacked batch gives. With ``antialias=True`` a crop larger than ``size`` is
    low-pass filtered as it shrinks, as PIL's and torchvision's bilinear resize do (the crop
    is taken whole, then resized with ``interpolate(..., antialias=True)``).
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        antialias: bool = False,
        on: Key | None = 0,
    ) -> None:
        super().__init__(seed, on)
        self.size = check.size("RandomResizedCrop", "size", size)
        if not isinstance(antialias, bool):
            raise TypeError(
                f"RandomResizedCrop(antialias=...) is True or False ({check.received(antialias)})"
            )
        self.antialias = antialias
        scale = check.pair("RandomResizedCrop", "scale", scale)
        ratio = check.pair("RandomResizedCrop", "ratio", ratio)
        if not (0 < scale[0] <= scale[1] <= 1) or not (0 < ratio[0] <= ratio[1]):
            raise ValueError(
                f"RandomResizedCrop needs 0 < scale[0] <= scale[1] <= 1 and 0 < ratio[0] <= "
                f"ratio[1] (got scale={scale}, ratio={ratio}); the defaults are "
                f"scale=(0.08, 1.0), ratio=(3/4, 4/3)"
            )
        self.scale, self.ratio = scale, ratio
        self.dtype = check.dtype("RandomResizedCrop", "dtype", dtype, floating=True)

    def boxes(self, n: int, height: int, width: int) -> torch.Tensor:
        """(N, 4) boxes as (top, left, height, width), drawn from the generator."""
        out = torch.empty(n, 4, dtype=torch.float64)
        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for i in range(n):
            draws = torch.rand(10, 4, generator=self.generator, dtype=torch.float64)
            for a, r, t, l in draws.tolist():  # noqa: E741
                target = area * (self.scale[0] + a * (self.scale[1] - self.scale[0]))
                aspect = math.exp(log_ratio[0] + r * (log_ratio[1] - log_ratio[0]))
                w = round(math.sqrt(target * aspect))
                h = round(math.sqrt(target / aspect))
                if 0 < w <= width and 0 < h <= height:
                    out[i] = torch.tensor(
                        [math.floor(t * (height - h + 1)), math.floor(l * (width - w + 1)), h, w]
                    )
                    break
            else:
                side = min(height, width)
                out[i] = torch.tensor([(height - side) // 2, (width - side) // 2, side, side])
        return out

    def apply(self, images: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Output (N, C, *size) in ``dtype``, in the input's memory format (NCHW for a list).

        ``grid_sample`` needs a float source and a sampling grid, and a whole batch of either
        can be several times the output (a 4x larger input area is 4x the output as float).
        So the batch goes through in chunks, each written into the output; images are
        independent, so chunking changes no value.

        Memory bound: a chunk's transients are its source, grid and result in the working
        dtype (float32, or float64 for a float64 ``dtype``), ``(C*H*W + (C+2)*h*w) * 4``
        bytes per image for an (H, W) input and an (h, w) output. A chunk holds as many
        images as fit in half the output's bytes, but at least one, so the transients stay
        within max(half the output, one image's transients). With a half-precision output,
        375x500 -> 224 takes 3.3 MB of transients per image, 11 times that image's output:
        batches of 22 or more stay within half the output, smaller ones hold one image's.
        """
        if not isinstance(images, torch.Tensor):
            return self._apply_each(images)
        check_batch("RandomResizedCrop", images)
        n, channels, height, width = images.shape
        boxes = self.boxes(n, height, width)
        if self.antialias:
            out = self._empty(n, channels, images, memory_format(images))
            for i, box in enumerate(boxes.tolist()):
                out[i] = self._resize(images[i], box)
            return out
        top, left, h, w = boxes.unbind(1)
        # Affine map from output to input in grid_sample's normalised coordinates.
        theta = torch.zeros(n, 2, 3, dtype=torch.float64)
        theta[:, 0, 0] = w / width
        theta[:, 0, 2] = (2 * left + w) / width - 1
        theta[:, 1, 1] = h / height
        theta[:, 1, 2] = (2 * top + h) / height - 1
        # The grid and the sampling in at least float32: half precision cannot address the
        # pixels of a 500-wide image (its spacing there is 0.25 to 0.5 of a pixel) and its
        # weights round badly; the output is rounded to ``dtype`` once, when it is written.
        work = torch.promote_types(self.dtype, torch.float32)
        theta = upload(theta.to(work), images.device)
        out_h, out_w = self.size
        output_bytes = n * channels * out_h * out_w * self.dtype.itemsize
        per_image = (channels * height * width + out_h * out_w * (2 + channels)) * work.itemsize
        chunk = max(1, output_bytes // 2 // per_image)
        out = self._empty(n, channels, images, memory_format(images))
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            out[start:stop] = self._sample(images[start:stop], theta[start:stop])
        return out

    def _apply_each(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        """A list of (C, H, W) images: a box drawn per image, in order, each resized alone.

        The boxes are drawn as for a batch (one image after the other from the generator),
        so images of one size give their stacked batch's output. Transients: one image's.
        """
        first = images[0]
        for i, image in enumerate(images):
            if image.dim() != 3 or image.shape[0] != first.shape[0]:
                raise ValueError(
                    f"RandomResizedCrop takes a list of (C, H, W) images with the same C; item "
                    f"{i} has shape {tuple(image.shape)}, item 0 {tuple(first.shape)}. For a "
                    f"batch of parts such as [images, labels], pass on=0 (the images' index)"
                )
            if image.device != first.device:
                raise ValueError(
                    f"RandomResizedCrop: image {i} is on {image.device}, image 0 on "
                    f"{first.device}; pass images on one device"
                )
        out = self._empty(len(images), first.shape[0], first, torch.contiguous_format)
        boxes = [self.boxes(1, *image.shape[-2:])[0] for image in images]
        if self.antialias:
            for i, (image, box) in enumerate(zip(images, boxes, strict=True)):
                out[i] = self._resize(image, box.tolist())
            return out
        sizes = torch.tensor([image.shape[-2:] for image in images], dtype=torch.float64)
        top, left, h, w = torch.stack(boxes).unbind(1)
        height, width = sizes.unbind(1)
        theta = torch.zeros(len(images), 2, 3, dtype=torch.float64)
        theta[:, 0, 0] = w / width
        theta[:, 0, 2] = (2 * left + w) / width - 1
        theta[:, 1, 1] = h / height
        theta[:, 1, 2] = (2 * top + h) / height - 1
        work = torch.promote_types(self.dtype, torch.float32)
        theta = upload(theta.to(work), first.device)  # one upload for the batch
        for i, image in enumerate(images):
            out[i] = self._sample(image[None], theta[i : i + 1])[0]
        return out

    def _empty(
        self, n: int, channels: int, like: torch.Tensor, layout: torch.memory_format
    ) -> torch.Tensor:
        out_h, out_w = self.size
        return torch.empty(
            n, channels, out_h, out_w, dtype=self.dtype, device=like.device, memory_format=layout
        )

    def _resize(self, image: torch.Tensor, box: list[float]) -> torch.Tensor:
        """One (C, H, W) image's ``box`` (top, left, height, width), resized with antialiasing."""
        top, left, h, w = (int(v) for v in box)
        work = torch.promote_types(self.dtype, torch.float32)
        crop = image[None, :, top : top + h, left : left + w].to(work)
        if not image.is_floating_point():
            crop.mul_(1.0 / max_value(image.dtype))
        return F.interpolate(
            crop, size=self.size, mode="bilinear", align_corners=False, antialias=True
        )[0]

    def _sample(self, images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
        grid = F.affine_grid(
            theta, [images.shape[0], images.shape[1], *self.size], align_corners=False
        )
        source = images.to(theta.dtype)
        if not images.is_floating_point():
            source.mul_(1.0 / max_value(images.dtype))
        return F.grid_sample(
            source, grid, mode="bilinear", padding_mode="border", align_corners=False
        )
