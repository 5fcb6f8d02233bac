"""Transforms of a batch's type, values and layout: ToDtype, Normalize, ChannelsLast."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .. import _arguments as check
from ..cuda._transfer import upload
from ._base import Key, Transform, check_batch, current_stream, max_value


class ToDtype(Transform):
    """Cast to ``dtype``; from an integer type to a float type, scale to [0, 1] (``scale``)."""

    def __init__(self, dtype: torch.dtype, *, scale: bool = True, on: Key | None = 0) -> None:
        super().__init__(on)
        self.dtype = check.dtype("ToDtype", "dtype", dtype, floating=False)
        check.flag("ToDtype", "scale", scale)
        self.scale = scale

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """One allocation: the output."""
        out = images.to(self.dtype)
        if self.scale and not images.is_floating_point() and self.dtype.is_floating_point:
            out.mul_(1.0 / max_value(images.dtype))
        return out


class Normalize(Transform):
    """(x - mean) / std per channel; a uint8 input is cast and scaled to [0, 1] first, fused.

    For integer input the cast, the scaling and the normalisation are one cast plus one fused
    multiply-add in place: ``x * (1 / (max * std)) - mean / std``, computed in float32 (or
    float64) and rounded to ``dtype`` once. Float input is taken as already in [0, 1], as
    :class:`ToDtype` and :class:`RandomResizedCrop` give it, and keeps its dtype.
    """

    #: Coefficient pairs kept on devices (one per device, dtype and stream in use).
    _CACHED = 8
    #: One lock for every instance's cache (a lock per instance would not pickle): a
    #: transform shared by two prefetchers, or called by the producer and the consumer, must
    #: not evict the same entry twice or read one half-made.
    _CACHE_LOCK = threading.Lock()

    def __init__(
        self,
        mean: Sequence[float],
        std: Sequence[float],
        *,
        dtype: torch.dtype = torch.float32,
        on: Key | None = 0,
    ) -> None:
        super().__init__(on)
        mean, std = check.numbers("Normalize", "mean", mean), check.numbers("Normalize", "std", std)
        if not all(math.isfinite(v) for v in (*mean, *std)):
            raise ValueError(
                f"Normalize needs finite means and stds (got mean={list(mean)}, "
                f"std={list(std)}); pass the per-channel statistics of the training images"
            )
        if len(mean) != len(std):
            raise ValueError(
                f"Normalize needs one mean and one std per channel (got {len(mean)} means and "
                f"{len(std)} stds); pass e.g. mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]"
            )
        if any(s <= 0 for s in std):
            raise ValueError(
                f"Normalize: every std must be > 0 (got std={list(std)}); pass the per-channel "
                f"standard deviations, e.g. std=(0.229, 0.224, 0.225)"
            )
        self.mean, self.std = mean, std
        self.dtype = check.dtype("Normalize", "dtype", dtype, floating=True)
        #: Device coefficients by (device, dtype, scale, stream), at most ``_CACHED`` of them.
        self._cache: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _coefficients(
        self, images: torch.Tensor, scale: float, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = images.device
        # Per stream on CUDA: a cached tensor written on one stream is only ever read there
        # (reading it from another would need a wait first).
        key = (device, dtype, scale, current_stream(device))
        with self._CACHE_LOCK:
            return self._cached(key, device, scale, dtype)

    def _cached(
        self, key: tuple[Any, ...], device: torch.device, scale: float, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The coefficients for ``key``, made and cached if missing; the caller holds the lock."""
        coefficients = self._cache.get(key)
        if coefficients is None:
            shape = (1, len(self.mean), 1, 1)
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            # Cast on the host, then upload from pinned memory: no host sync in the copy path.
            mul = (1.0 / (scale * std)).reshape(shape).to(dtype)
            add = (-mean / std).reshape(shape).to(dtype)
            coefficients = (upload(mul, device), upload(add, device))
            if len(self._cache) >= self._CACHED:
                # A prefetcher per epoch brings a new copy stream each time: drop the oldest.
                # Safe while a kernel may still read it: its memory is reused only by later
                # work on the stream it was made on, which that stream orders after the read.
                del self._cache[next(iter(self._cache))]
            self._cache[key] = coefficients
        return coefficients

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """One allocation: the output (the coefficients are cached per device and dtype)."""
        check_batch("Normalize", images)
        if images.shape[1] != len(self.mean):
            raise ValueError(
                f"Normalize(mean, std) has {len(self.mean)} channels but the images are "
                f"{tuple(images.shape)} (N, C, H, W); give one mean and std per channel"
            )
        if images.is_floating_point():
            dtype, scale = images.dtype, 1.0
        else:
            dtype, scale = self.dtype, float(max_value(images.dtype))
        # Coefficients in at least float32 and one fused multiply-add: the result is rounded to
        # ``dtype`` once (for bfloat16 and float16 the correctly rounded value, the same on
        # every device), where in-place steps in ``dtype`` would round three times.
        mul, add = self._coefficients(images, scale, torch.promote_types(dtype, torch.float32))
        out = images.to(dtype, copy=images.is_floating_point())
        if out.device.type == "cpu" and mul.dtype != out.dtype and len(out) > 1:
            # CPU kernels compute mixed dtypes through temporaries in the computing dtype (two
            # of them, each twice a half-precision output): a sixteenth of the batch at a time
            # keeps them within a quarter of the output. GPU kernels cast as they go.
            for part in torch.split(out, -(-len(out) // 16)):
                torch.addcmul(add, part, mul, out=part)
            return out
        return torch.addcmul(add, out, mul, out=out)


class ChannelsLast(Transform):
    """Store images channels-last (NHWC in memory), which convolutions on recent GPUs prefer."""

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """A copy in the new layout (none if it is already so)."""
        check_batch("ChannelsLast", images)
        return images.contiguous(memory_format=torch.channels_last)
