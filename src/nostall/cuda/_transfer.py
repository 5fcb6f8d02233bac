"""Moving batches between host and device: the primitives every transfer is made of.

The public helpers :func:`to_device` and :func:`pin_memory` work on any nested batch;
:func:`upload` copies a small tensor without a host sync; :func:`record_stream` protects a
tensor's memory (sparse and nested ones included) for a stream. A prefetcher's staging
(:mod:`nostall._staging.base`, :mod:`nostall._staging.cuda`) is built from them.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from .._device import DeviceLike, resolve_device
from .._exceptions import DeviceUnavailableError
from ._tree import UNHANDLED, map_tensors

T = TypeVar("T")


def to_device(batch: T, device: DeviceLike, *, non_blocking: bool = False) -> T:
    """Return ``batch`` with every tensor moved to ``device``, every container kept as its type.

    Tensors are moved with ``Tensor.to``; objects with their own ``.to()`` method are asked to move
    themselves (called as ``.to(device, non_blocking=...)``, falling back to ``.to(device)`` when
    they do not accept ``non_blocking``). Strings, bytes, numbers, None and other objects are
    returned unchanged. See :mod:`nostall.cuda._tree` for the containers that are rebuilt.

    Args:
        batch: a tensor or any nested structure holding tensors.
        device: where to move them (see :func:`nostall.prefetch` for what is accepted).
        non_blocking: passed to ``Tensor.to``. Asynchronous are a copy from pinned host memory
            to a GPU, and a copy from a GPU to the host (PyTorch then allocates the result in
            pinned memory): after the latter the host must synchronise (the stream or an
            event) before reading the result. Reading a copy's result on another stream needs
            a wait first. From pageable host memory to a GPU the copy is synchronous.

    Raises:
        DeviceUnavailableError: ``device`` does not exist on this machine.
    """
    dev = resolve_device(device)
    return map_tensors(
        batch,
        lambda t: t.to(dev, non_blocking=non_blocking),
        lambda obj: call_to(obj, dev, non_blocking),
    )


def pin_memory(batch: T) -> T:
    """Return ``batch`` with every CPU tensor in page-locked (pinned) memory.

    Tensors already pinned or not on the CPU are returned as they are; objects with their own
    ``.pin_memory()`` method are asked to pin themselves. Pinned memory is what lets a copy to a
    GPU run asynchronously (``non_blocking=True``).

    Raises:
        DeviceUnavailableError: no CUDA device is present; pinning needs one, and only helps
            copies to one.
    """
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "pin_memory() needs CUDA: pinned memory is page-locked for copies to a GPU, and no "
            "CUDA device is available here; without a GPU there is nothing to pin for, so skip "
            "this call (nostall.prefetch does so by itself on the CPU)"
        )
    return map_tensors(batch, _pin_tensor, call_pin_memory)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor (indices, boxes, coefficients) to ``device`` without a host sync.

    On CUDA the tensor is pinned first and copied with ``non_blocking=True``: a copy from
    pageable memory blocks the calling thread until the copy stream has drained, which inside
    a transform on the copy stream stalls the producer for every batch. The pinned buffer is
    kept alive by PyTorch's host allocator until the copy has run, so it may die here.
    Elsewhere this is ``t.to(device)``.
    """
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _pin_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu" or t.is_pinned():
        return t
    return compact(t).pin_memory()


def compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy of it where it is a view with gaps (``x[:, ::4]``).

    ``pin_memory()`` keeps a tensor's strides, so it pins the whole span the view reaches:
    four times its data for ``x[:, ::4]``, and the copy to the GPU moves all of it. A
    contiguous copy first pins and moves only the data; ``.to()`` of such a view gives a
    contiguous tensor anyway. Dense views (a permutation, channels-last) and expanded ones
    (stride 0) are returned as they are.
    """
    if type(t) is not torch.Tensor or t.layout != torch.strided:
        return t  # a subclass (torchvision's tv_tensors) keeps its type and metadata as it is
    if t.is_contiguous() or t.numel() == 0:
        return t  # no gaps (the common batch: one C call, not a sum over the dimensions)
    span = 1 + sum(
        (size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True)
    )
    return t.contiguous() if span > t.numel() else t


def call_pin_memory(obj: Any) -> Any:
    method = getattr(obj, "pin_memory", None)
    return method() if callable(method) else UNHANDLED


def call_to(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    method = getattr(obj, "to", None)
    if not callable(method):
        return UNHANDLED
    if not non_blocking:
        return method(device)
    try:
        return method(device, non_blocking=True)
    except TypeError:
        # Their .to() does not take non_blocking; a blocking copy is still correct.
        return method(device)


def dense_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors that hold ``t``'s memory: ``t`` itself unless sparse or nested.

    ``record_stream`` needs a tensor with storage; a sparse tensor keeps its memory in its
    index and value tensors, a nested tensor in its buffer.
    """
    layout = t.layout
    if layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    if t.is_nested:
        if layout == torch.jagged:
            # NestedTensor (jagged) exposes these; the stubs of torch.Tensor do not.
            lengths = t.lengths()  # type: ignore[attr-defined]
            offsets = t.offsets()  # type: ignore[attr-defined]
            return [t.values(), offsets] + ([] if lengths is None else [lengths])
        return list(t.unbind())  # strided nested: views of one buffer
    return [t]


def record_stream(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """``t.record_stream(stream)`` for every dense tensor holding ``t``'s memory."""
    for part in dense_parts(t):
        part.record_stream(stream)
