"""What every transform shares: ``on``, the state protocol, Compose, checks and helpers."""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from .. import _arguments as check
from ._encoded import EncodedImages

Key = Hashable | int


class Images(list):  # type: ignore[type-arg]
    """A list of (C, H, W) images of any sizes (as DecodeJPEG gives them): one part of a batch.

    A bare one is a batch of images, never a batch of parts such as ``[images, labels]``.
    """


class Transform:
    """A batch transform applied to the part of the batch named by ``on``.

    Every one keeps :class:`~nostall.transforms.StatefulTransform` (``state_dict`` and
    ``load_state_dict``), so a prefetcher's checkpoint holds its state.
    """

    def __init__(self, on: Key | None = 0) -> None:
        self.on = _key(type(self).__name__, on)

    #: What :meth:`apply` takes, in words (for errors): see :meth:`accepts`.
    takes = "a tensor"

    def __call__(self, batch: Any) -> Any:
        """Return ``batch`` with the selected part replaced by its transformed version.

        A bare batch of what the transform takes (a tensor) is transformed whole; so is any
        batch with ``on=None``. A list or tuple is taken whole only with ``on=None`` or when it
        is an :class:`Images` list: otherwise it is a batch of parts, ``(images, labels)``.
        """
        whole = self.accepts(batch) and (
            self.on is None or type(batch) is Images or not isinstance(batch, (list, tuple))
        )
        if whole:
            return self.apply(batch)
        if self.on is None:
            fix = self.fix_for(batch) or "pass on=KEY for a dict or on=INDEX for a tuple"
            raise ValueError(
                f"{type(self).__name__}(on=None) needs {self.takes} as the batch (got a "
                f"{type(batch).__name__}); {fix}"
            )
        return _replace(batch, self.on, self.apply, type(self).__name__, self)

    def accepts(self, part: object) -> bool:
        """Whether ``part`` is what :meth:`apply` works on: here a tensor."""
        return isinstance(part, torch.Tensor)

    def fix_for(self, part: object) -> str:
        """What to change when ``part`` is not what this transform takes ('' if nothing known)."""
        return ""

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """Transform one batch tensor."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the transform's random draws exactly.

        ``nostall.prefetch`` saves it per batch, so that ``Prefetcher.state_dict`` holds the
        state after the last batch handed out, not after the batches transformed ahead.
        """
        return {"type": type(self).__name__}

    def check_state(self, state: object) -> None:
        """Raise ``ValueError`` unless ``state`` came from an identically built transform."""
        if not isinstance(state, Mapping) or state.get("type") != type(self).__name__:
            got = state.get("type") if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"this transform state is not from a {type(self).__name__} (got {got!r}); "
                f"build the same transforms, in the same order, as when it was saved"
            )

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`)."""
        self.check_state(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(on={self.on!r})"


def _replace(
    batch: Any, key: Key, fn: Callable[[Any], Any], name: str, transform: Transform
) -> Any:
    try:
        value = batch[key]
    except (KeyError, IndexError, TypeError) as e:
        keys = f" (its keys: {', '.join(map(repr, batch))})" if isinstance(batch, Mapping) else ""
        raise ValueError(
            f"{name}(on={key!r}) found nothing at {key!r} in a batch of type "
            f"{type(batch).__name__}{keys}; use on=KEY for a dict batch, on=INDEX for a tuple"
        ) from e
    if not transform.accepts(value):
        fix = transform.fix_for(value)
        raise ValueError(
            f"{name}(on={key!r}) needs {transform.takes} there (got {type(value).__name__})"
            + (f"; {fix}" if fix else "")
        )
    new = fn(value)
    if isinstance(batch, tuple):
        items = list(batch)
        items[key] = new  # type: ignore[index]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    out = copy.copy(batch)  # a list or a mapping: keep its type (and a defaultdict's factory)
    out[key] = new
    return out


class Compose(Transform):
    """Apply transforms one after the other.

    With ``on=None`` (the default) each transform selects its own part of the batch. With
    ``on=KEY`` the whole pipeline runs on that one part, handed to each transform as a bare
    tensor batch (their own ``on`` is then not used); the rest of the batch is kept.
    """

    def __init__(
        self, transforms: Sequence[Callable[[Any], Any]], *, on: Key | None = None
    ) -> None:
        super().__init__(on)
        given: object = transforms  # checked at run time: callers are not type-checked
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise TypeError(
                f"Compose(transforms) takes a list of transforms (got {transforms!r}, a "
                f"{type(transforms).__name__}); pass Compose([T.Normalize(...), ...])"
            )
        for i, t in enumerate(transforms):
            if not callable(t):
                raise TypeError(
                    f"Compose(transforms): transforms[{i}] is not callable (got {t!r}, a "
                    f"{type(t).__name__}); pass transforms such as T.Normalize(...) or functions"
                )
        self.transforms = list(transforms)

    def __call__(self, batch: Any) -> Any:
        """Each transform in turn, on the whole batch or on the part named by ``on``."""
        if self.on is None:
            for transform in self.transforms:
                batch = transform(batch)
            return batch
        return super().__call__(batch)

    @property
    def takes(self) -> str:  # type: ignore[override]
        """What the first transform takes (a tensor for a plain function)."""
        first = self.transforms[0] if self.transforms else None
        return first.takes if isinstance(first, Transform) else "a tensor"

    def fix_for(self, part: object) -> str:
        """The first transform's advice."""
        first = self.transforms[0] if self.transforms else None
        return first.fix_for(part) if isinstance(first, Transform) else ""

    def accepts(self, part: object) -> bool:
        """With ``on``: what the first transform takes (a tensor for a plain function)."""
        first = self.transforms[0] if self.transforms else None
        if isinstance(first, Transform):
            return first.accepts(part)
        return isinstance(part, torch.Tensor)

    def apply(self, images: Any) -> Any:
        """The pipeline on one part (with ``on``): a list there is a list of images."""
        if isinstance(images, (list, tuple)) and type(images) is not Images:
            images = Images(images)
        for transform in self.transforms:
            images = transform(images)
        return images

    def state_dict(self) -> dict[str, Any]:
        """Each transform's state, in order (``None`` for callables without one)."""
        return {
            "type": "Compose",
            "transforms": [
                t.state_dict() if isinstance(t, Transform) else None for t in self.transforms
            ],
        }

    def check_state(self, state: object) -> None:
        """Raise ``ValueError`` unless ``state`` fits these transforms, one by one."""
        super().check_state(state)
        assert isinstance(state, Mapping)
        states = state.get("transforms")
        if not isinstance(states, list) or len(states) != len(self.transforms):
            count = len(states) if isinstance(states, list) else states
            raise ValueError(
                f"this Compose state holds {count} transforms, this Compose has "
                f"{len(self.transforms)}; build the same transforms as when it was saved"
            )
        for t, sub in zip(self.transforms, states, strict=True):
            if isinstance(t, Transform):
                t.check_state(sub)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load each transform's state."""
        self.check_state(state)
        for t, sub in zip(self.transforms, state["transforms"], strict=True):
            if isinstance(t, Transform):
                t.load_state_dict(sub)

    def __repr__(self) -> str:
        on = "" if self.on is None else f", on={self.on!r}"
        return f"Compose({self.transforms!r}{on})"


def memory_format(images: torch.Tensor) -> torch.memory_format:
    """Channels-last for a channels-last batch (as ``collate_uint8`` makes), else NCHW."""
    if images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


def current_stream(device: torch.device) -> Any:
    """The stream work on ``device`` is queued on now: CUDA's current stream, else None."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _key(owner: str, on: object) -> Key | None:
    """``on``: None, or a dict key or tuple index (hashable; never a bool, an index by accident)."""
    try:
        hash(on)
        unhashable = False
    except TypeError:  # a list or a dict: no key of a batch can be one
        unhashable = True
    if isinstance(on, bool) or unhashable:
        raise TypeError(
            f"{owner}(on=...) names the part of the batch to transform: a key of a dict batch "
            f"or an index of a tuple batch ({check.received(on)}); pass e.g. on='image' or "
            f"on=0 (on=None for a bare tensor batch)"
        )
    return on


def max_value(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.bool else torch.iinfo(dtype).max


def check_batch(name: str, images: torch.Tensor) -> None:
    """A batch of images is (N, C, H, W): a lone (C, H, W) image must not pass for C images."""
    if images.dim() != 4:
        fix = (
            "for one image add the batch dimension (image[None])"
            if images.dim() == 3
            else "pass images as (N, C, H, W), e.g. with collate_uint8 or reshape"
        )
        raise ValueError(
            f"{name} works on a batch of images (N, C, H, W) but got shape "
            f"{tuple(images.shape)}; {fix}"
        )


class TakesImages:
    """For a transform of images: a batch (N, C, H, W), or a list of (C, H, W) of any sizes."""

    takes = "a tensor, or a list of (C, H, W) images"

    def accepts(self, part: object) -> bool:
        """A tensor, or a list or tuple of tensors (images of any sizes)."""
        if isinstance(part, (list, tuple)):
            return bool(part) and all(isinstance(p, torch.Tensor) for p in part)
        return isinstance(part, torch.Tensor)

    def fix_for(self, part: object) -> str:
        """Encoded images are decoded first."""
        if isinstance(part, EncodedImages):
            return "these are encoded images: put T.DecodeJPEG() before this transform"
        return ""
