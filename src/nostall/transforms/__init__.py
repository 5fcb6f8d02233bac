"""Batch transforms that run on the device, after the copy, on the prefetcher's copy stream.

Image pipelines spend CPU cores turning uint8 images into normalised floats, and send four times
the bytes over PCIe. With ``nostall.prefetch(loader, transform=...)`` the batch crosses as uint8
and these transforms run on the GPU, on the copy stream, before the consumer's stream waits for
the batch, so they overlap the model's compute.

Invariants:
    * JPEGs can cross as their bytes and be decoded here: :class:`ImageBytes` reads the files,
      :func:`collate_encoded` packs a batch's bytes, :class:`DecodeJPEG` decodes them (nvJPEG
      on a GPU) into a list of images that :class:`RandomResizedCrop` (training) or
      :class:`ResizedCenterCrop` (evaluation) makes one batch.
    * Each transform works on a whole batch (N, C, H, W) and touches only the part of the batch
      named by ``on`` (a key of a dict batch, an index of a tuple or list batch; a bare tensor
      batch is transformed whole). The rest of the batch, and its container type, is kept.
    * The output keeps the input's memory format (NCHW or channels-last), except where
      :class:`ChannelsLast` sets it.
    * No transform blocks the host: the small host tensors they need on the device (flip
      indices, crop parameters, Normalize's coefficients) go through ``upload`` (pinned,
      ``non_blocking``), so a transform on the copy stream never stalls the producer.
    * Random transforms draw from their own CPU ``torch.Generator``, seeded at construction, one
      draw per batch, so a run is reproducible and gives the same numbers on CPU and CUDA.
      ``state_dict`` / ``load_state_dict`` carry the generator through a checkpoint, and
      ``nostall.prefetch`` saves it per batch handed out, so a resumed run draws what the
      uninterrupted run would have.
    * Any callable is a transform. Yours is checkpointed the same way when it keeps
      :class:`StatefulTransform` (``state_dict()`` and ``load_state_dict(state)``); one with
      only one of the two is refused with a ``TypeError`` at ``prefetch(...)``, since its state
      could not be restored on resume.
    * A transform allocates its output and at most small per-sample index or parameter
      tensors. ``RandomResizedCrop`` also holds transient float buffers, chunk by chunk: within
      half its output, or one image's buffers where those are more (small batches, see
      :meth:`RandomResizedCrop.apply`). In-flight memory is therefore bounded by the
      prefetcher's ``depth`` times the transformed batch, plus those transients.
"""

from .._transform_state import StatefulTransform
from ._base import Compose, Transform
from ._centre import ResizedCenterCrop
from ._decode import DecodeJPEG
from ._encoded import EncodedImage, EncodedImages, ImageBytes, collate_encoded
from ._random import RandomHorizontalFlip, RandomResizedCrop
from ._tensors import ChannelsLast, Normalize, ToDtype

__all__ = [
    "ChannelsLast",
    "Compose",
    "DecodeJPEG",
    "EncodedImage",
    "EncodedImages",
    "ImageBytes",
    "Normalize",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "ResizedCenterCrop",
    "StatefulTransform",
    "ToDtype",
    "Transform",
    "collate_encoded",
]
