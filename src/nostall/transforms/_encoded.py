"""Encoded images: files read as bytes, batched as bytes, decoded on the device.

A DataLoader that decodes JPEGs spends most of its CPU time in the decoder. Here the dataset
reads each file's bytes (:class:`ImageBytes`), the collate packs a batch's bytes into one host
buffer (:func:`collate_encoded` makes an :class:`EncodedImages`), and
:class:`~nostall.transforms.DecodeJPEG` decodes them where the batch goes: nvJPEG on a GPU.

Invariants:
    * An :class:`EncodedImages` holds its images' bytes back to back in one 1-D uint8 host
      tensor, with ``len + 1`` offsets; image ``i`` is ``data[offsets[i]:offsets[i + 1]]``,
      byte for byte the file that was read. Its ``.to(device)`` keeps the bytes on the host
      (GPU decoders read host memory) and records the device the images are to be decoded on.
    * Each image keeps the name it was read under (its path), so that an error names the file.
    * In a DataLoader worker the packed bytes go to shared memory (one copy more), as
      ``default_collate`` puts a batch there, so sending them to the main process copies nothing.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from .. import _arguments as check
from .._torch_compat import collate_with, empty_shared_uint8

#: The file endings an image folder's files are taken with, as torchvision's ImageFolder.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class EncodedImage(bytes):
    """One image file's bytes, with the name it was read under (shown in decode errors)."""

    name: str

    def __new__(cls, data: bytes, name: str = "") -> EncodedImage:
        """``data`` as it is, named ``name``."""
        self = super().__new__(cls, data)
        self.name = name
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (EncodedImage, (bytes(self), self.name))

    def __repr__(self) -> str:
        return f"EncodedImage({len(self)} bytes, name={self.name!r})"


class ImageBytes(Dataset[tuple[EncodedImage, int]]):
    """A dataset of image files read as bytes, with their class index: ``(EncodedImage, int)``.

    ``source`` is one of:

    * a directory with a folder per class, as torchvision's ``ImageFolder`` reads it (classes
      sorted by name, files sorted, those ending in one of ``extensions``);
    * a dataset with ``.samples``, a list of ``(path, class_index)``: torchvision's
      ``ImageFolder`` or ``DatasetFolder`` (its ``classes`` and ``class_to_idx`` are kept);
    * a list of paths (each with class index 0) or of ``(path, class_index)`` pairs.

    As ``ImageFolder``, a folder with a class folder holding no image is refused unless
    ``allow_empty=True``.

    The files are read, not decoded: decode them on the device with
    :class:`~nostall.transforms.DecodeJPEG`, after :func:`collate_encoded`.
    """

    def __init__(
        self,
        source: Any,
        *,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        allow_empty: bool = False,
    ) -> None:
        self.classes: list[str] = []
        self.class_to_idx: dict[str, int] = {}
        self.allow_empty = allow_empty
        if isinstance(source, (str, os.PathLike)):
            root = Path(source).expanduser()
            self.samples = self._scan(root, tuple(e.lower() for e in extensions))
        elif isinstance(getattr(source, "samples", None), list):
            self.samples = [(str(path), int(target)) for path, target in source.samples]
            self.classes = list(getattr(source, "classes", []))
            self.class_to_idx = dict(getattr(source, "class_to_idx", {}))
        elif isinstance(source, Sequence):
            self.samples = [_pair(item, i) for i, item in enumerate(source)]
        else:
            raise TypeError(
                f"ImageBytes(source) takes a directory, a dataset with .samples (torchvision's "
                f"ImageFolder) or a list of paths ({check.received(source)}); pass e.g. "
                f"ImageBytes('train/') or ImageBytes(ImageFolder('train/'))"
            )
        self.targets = [target for _, target in self.samples]

    def _scan(self, root: Path, extensions: tuple[str, ...]) -> list[tuple[str, int]]:
        if not root.is_dir():
            raise ValueError(
                f"ImageBytes(source) found no directory at {str(root)!r}; pass a folder with "
                f"one subfolder of images per class (as torchvision's ImageFolder reads)"
            )
        self.classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        # In torchvision's order: each class folder walked (links followed), folders sorted,
        # then the files of each, sorted, so that indices match an ImageFolder's.
        samples = [
            (os.path.join(folder, name), self.class_to_idx[label])
            for label in self.classes
            for folder, _, names in sorted(os.walk(root / label, followlinks=True))
            for name in sorted(names)
            if name.lower().endswith(extensions)
        ]
        if not samples:
            raise ValueError(
                f"ImageBytes(source) found no image files in class folders under {str(root)!r} "
                f"(endings {', '.join(extensions)}); images go in {root!s}/<class>/<file>"
            )
        empty = sorted(set(self.classes) - {self.classes[t] for _, t in samples})
        if (
            empty and not self.allow_empty
        ):  # as ImageFolder: a class without an image is a mistake in the folder
            raise ValueError(
                f"ImageBytes(source) found no image files for the classes {', '.join(empty)} "
                f"under {str(root)!r} (endings {', '.join(extensions)}); remove their folders, "
                f"put their images in them, or pass allow_empty=True"
            )
        return samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[EncodedImage, int]:
        path, target = self.samples[index]
        with open(path, "rb") as file:
            return EncodedImage(file.read(), path), target

    def __repr__(self) -> str:
        return f"ImageBytes({len(self.samples)} files, {len(self.classes)} classes)"


def _pair(item: Any, index: int) -> tuple[str, int]:
    if isinstance(item, (str, os.PathLike)):
        return str(item), 0
    if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], (str, os.PathLike)):
        return str(item[0]), int(item[1])
    raise TypeError(
        f"ImageBytes(source): source[{index}] is neither a path nor a (path, class_index) pair "
        f"({check.received(item)}); pass paths, or (path, class_index) pairs"
    )


class EncodedImages:
    """A batch of encoded images, their bytes back to back in one host tensor.

    Made by :func:`collate_encoded`; decoded by :class:`~nostall.transforms.DecodeJPEG`.
    ``len()`` images; ``batch[i]`` is image ``i``'s bytes (a uint8 view); ``names[i]`` the name it
    was read under (``''`` if none). ``device`` is where the images are to be decoded.
    """

    #: nostall's staging: ``.to(device)`` keeps the bytes on the host by design (decoders
    #: read host memory), so it looks for no device tensor in what ``.to()`` returns.
    read_on_host = True

    __slots__ = ("data", "device", "names", "offsets")

    def __init__(
        self,
        data: torch.Tensor,
        offsets: torch.Tensor,
        names: Sequence[str] = (),
        device: torch.device | str = "cpu",
    ) -> None:
        if data.dim() != 1 or data.dtype != torch.uint8 or data.device.type != "cpu":
            raise ValueError(
                f"EncodedImages(data) is one 1-D uint8 host tensor of bytes (got shape "
                f"{tuple(data.shape)}, {data.dtype} on {data.device}); build it with "
                f"collate_encoded or EncodedImages.from_buffers"
            )
        self.data, self.offsets = data, offsets
        count = len(offsets) - 1
        self.names = tuple(names) if names else ("",) * count
        if len(self.names) != count:
            raise ValueError(
                f"EncodedImages(names) has {len(self.names)} names for {count} images; "
                f"pass one name per image, or none"
            )
        self.device = torch.device(device)

    @classmethod
    def from_buffers(cls, buffers: Sequence[Any]) -> EncodedImages:
        """Pack bytes-like ``buffers`` (their ``.name`` kept where they have one).

        In a DataLoader worker the packed bytes are then copied into shared memory.
        """
        views = [_flat(b) for b in buffers]
        sizes = [len(v) for v in views]
        offsets = torch.zeros(len(views) + 1, dtype=torch.int64)
        if views:
            torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0, out=offsets[1:])
        total = int(offsets[-1])
        packed = bytearray(total)  # one memcpy per image; torch.frombuffer shares it
        start = 0
        for view, size in zip(views, sizes, strict=True):
            packed[start : start + size] = view
            start += size
        data = (
            torch.frombuffer(packed, dtype=torch.uint8)
            if total
            else torch.empty(0, dtype=torch.uint8)
        )
        if get_worker_info() is not None:
            data = empty_shared_uint8((total,)).copy_(data)
        names = [getattr(b, "name", "") or "" for b in buffers]
        return cls(data, offsets, names)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(f"image {index} of a batch of {len(self)} encoded images")
        index %= len(self)
        start, stop = self.offsets[index : index + 2].tolist()
        return self.data[start:stop]

    def buffers(self) -> list[torch.Tensor]:
        """Each image's bytes, as a 1-D uint8 view of :attr:`data`."""
        bounds = self.offsets.tolist()
        return [self.data[a:b] for a, b in itertools.pairwise(bounds)]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> EncodedImages:
        """The same bytes (on the host), to be decoded on ``device``."""
        return EncodedImages(self.data, self.offsets, self.names, device)

    def pin_memory(self) -> EncodedImages:
        """The bytes in pinned memory: GPU decoders copy them to the device from there."""
        return EncodedImages(self.data.pin_memory(), self.offsets, self.names, self.device)

    def __repr__(self) -> str:
        return f"EncodedImages({len(self)} images, {self.data.numel()} bytes, for {self.device})"


def _flat(buffer: Any) -> memoryview:
    """``buffer``'s bytes as a flat view (copied where it is not contiguous)."""
    view = memoryview(buffer)
    return view.cast("B") if view.contiguous else memoryview(view.tobytes())


def _collate_buffers(batch: Sequence[Any], *, collate_fn_map: Any = None) -> EncodedImages:
    return EncodedImages.from_buffers(batch)


_BUFFERS: dict[type, Callable[..., Any]] = {
    bytes: _collate_buffers,
    bytearray: _collate_buffers,
    memoryview: _collate_buffers,
}


def collate_encoded(samples: Sequence[Any]) -> Any:
    """``default_collate``, except that bytes become one :class:`EncodedImages`.

    Samples as :class:`ImageBytes` gives them, ``(EncodedImage, class_index)``, become
    ``[EncodedImages, labels]``; any structure ``default_collate`` takes (tuples, dicts) works
    the same, each field of ``bytes``, ``bytearray`` or ``memoryview`` packed into one
    :class:`EncodedImages` and every other field collated as ``default_collate`` does.
    """
    return collate_with(samples, _BUFFERS)
