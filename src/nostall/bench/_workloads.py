"""The bench's workloads: synthetic images of a set cost, JPEG files decoded with PIL, a convnet.

Each dataset gives an index the same sample on every call, in any process, so that any two
ways of loading it can be compared batch for batch.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import random
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset


@functools.cache
def hash_bytes_per_ms() -> float:
    """Bytes ``hashlib.sha256`` digests per millisecond here, in one thread.

    Hashing stands in for decoding: native code that releases the GIL, as decoders do.
    """
    buffer = bytes(1 << 20)
    best = min(timeit.repeat(lambda: hashlib.sha256(buffer).digest(), number=1, repeat=5))
    return len(buffer) / (best * 1e3)


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """(C, H, W) uint8 images; loading one costs ``decode_ms`` of hashing and ``io_ms`` of sleep."""

    def __init__(
        self, length: int, *, size: int = 64, decode_ms: float = 0, io_ms: float = 0
    ) -> None:
        self.length, self.io_ms = length, io_ms
        self._payload = bytes(int(decode_ms * hash_bytes_per_ms()) if decode_ms > 0 else 0)
        # Pixels vary within an image, so that a layout mistake changes values.
        self._pattern = (torch.arange(3 * size**2) % 251).to(torch.uint8).reshape(3, size, size)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.io_ms:
            time.sleep(self.io_ms / 1e3)
        if self._payload:
            hashlib.sha256(self._payload).digest()
        return self._pattern + index % 251, index % 10


def jpeg_files(folder: str | None, count: int) -> list[Path]:
    """``count`` JPEG files in ``folder`` (default ``~/.cache/nostall/bench-jpeg``), made once.

    Seeded smooth noise, 320-376 x 360-488 pixels: it compresses like a photograph (about
    40 kB), where flat colour would decode unrealistically fast.
    """
    from PIL import Image  # the bench extra

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = Path(folder) if folder else cache / "nostall" / "bench-jpeg"
    where.mkdir(parents=True, exist_ok=True)
    paths = [where / f"{i:06d}.jpg" for i in range(count)]
    for i, path in enumerate(paths):
        if not path.exists():
            size = (360 + 16 * (i % 9), 320 + 8 * (i % 8))
            coarse = random.Random(i).randbytes(size[0] // 8 * (size[1] // 8) * 3)
            image = Image.frombytes("RGB", (size[0] // 8, size[1] // 8), coarse)
            part = path.with_suffix(".part")  # a bench stopped halfway leaves no broken file
            image.resize(size, Image.Resampling.BILINEAR).save(part, "JPEG", quality=90)
            part.replace(path)
    return paths


class JpegImages(Dataset[tuple[torch.Tensor, int]]):
    """JPEG files decoded with PIL, cropped and resized to ``size`` x ``size``: CHW uint8.

    The crop is ``RandomResizedCrop``'s, drawn from the index (35-100% of the area, 3/4-4/3).
    """

    def __init__(self, paths: list[Path], size: int = 224, length: int | None = None) -> None:
        self.paths, self.size = [str(p) for p in paths], size
        self.length = len(self.paths) if length is None else length  # past the files: cycled

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.paths[index % len(self.paths)]) as image:
            image = image.convert("RGB")
        draw, (width, height) = random.Random(index), image.size
        area, aspect = width * height * draw.uniform(0.35, 1.0), draw.uniform(3 / 4, 4 / 3)
        w = min(width, round((area * aspect) ** 0.5))
        h = min(height, round((area / aspect) ** 0.5))
        left, top = draw.randint(0, width - w), draw.randint(0, height - h)
        image = image.resize(
            (self.size, self.size), Image.Resampling.BILINEAR, (left, top, left + w, top + h)
        )
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        return pixels.view(self.size, self.size, 3).permute(2, 0, 1), index % 10


def random_resized_crop_box(
    width: int, height: int, scale: tuple[float, float] = (0.35, 1.0)
) -> tuple[int, int, int, int]:
    """A crop box (left, top, right, bottom) drawn as torchvision's ``RandomResizedCrop`` draws.

    From torch's global generator (``Tensor.uniform_``, ``torch.randint``), as torchvision's
    transforms draw: an area within ``scale`` of the image's and an aspect ratio within
    3/4-4/3 (drawn on a log scale), up to ten tries, then the centre crop.
    """
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left = int(torch.randint(0, width - w + 1, size=(1,)).item())
            top = int(torch.randint(0, height - h + 1, size=(1,)).item())
            return left, top, left + w, top + h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


class AugmentedJpegImages(JpegImages):
    """:class:`JpegImages` with torchvision's usual augmentations, drawn from global generators.

    A ``RandomResizedCrop`` (:func:`random_resized_crop_box`) and a horizontal flip with
    probability 1/2 (``torch.rand(1) < 0.5``, as ``RandomHorizontalFlip`` draws), then to a
    CHW uint8 tensor: what an image-classification pipeline does, without torchvision.
    """

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        with Image.open(self.paths[index % len(self.paths)]) as image:
            image = image.convert("RGB")
        box, flip = self.augmentation(*image.size)
        image = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box)
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        return pixels.view(self.size, self.size, 3).permute(2, 0, 1), index % 10

    def augmentation(self, width: int, height: int) -> tuple[tuple[int, int, int, int], bool]:
        """The crop box and whether to flip, for an image of ``width`` x ``height``: drawn."""
        box = random_resized_crop_box(width, height)
        return box, torch.rand(1).item() < 0.5


def train_step(width: int, device: torch.device) -> Callable[[Any], float]:
    """A training step (forward, backward, SGD) of a fresh small convnet of ``width`` channels.

    It reads the loss back (``.item()``), as logging loops do: its time includes the device's.
    """
    model = nn.Sequential(
        nn.Conv2d(3, width, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(2 * width, 2 * width, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, 10),
    ).to(device)
    optimizer, loss_fn = torch.optim.SGD(model.parameters(), lr=0.01), nn.CrossEntropyLoss()

    def step(batch: Any) -> float:
        images, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(images.contiguous().float().div_(255.0)), labels)
        loss.backward()
        optimizer.step()
        return float(loss.item())

    return step


class DeviceStep:
    """A GPU training step modelled on the CPU: a launch phase, then a wait for "the device".

    The launch phase is what the training thread does on a GPU: ``launch_ops`` small torch ops
    (each releases the GIL inside torch and takes it back), a little Python between them, a
    few ms in all. Then the thread waits without the GIL (``time.sleep``, as a CUDA
    synchronisation waits) until ``device_s`` has passed since the step began; a launch phase
    that overran leaves no wait. The call returns the launch phase's seconds: beside loading
    threads that hold the GIL, it is what grows. On a CUDA ``device`` the ops are real
    launches (the weights live there; batches arrive there), and the wait still models the
    device's time, so that the figures compare with the CPU machine's.
    """

    def __init__(
        self, launch_ops: int, device_s: float = 0.0, device: torch.device | None = None
    ) -> None:
        self.launch_ops, self.device_s = launch_ops, device_s
        self.device = device or torch.device("cpu")
        self._weights = [torch.full((64,), 1.0 + i / 8, device=self.device) for i in range(8)]

    def place(self, batch: Any) -> Any:
        """``batch`` on the step's device, as the contenders hand it out (a probe's batch)."""
        images, labels = batch
        return images.to(self.device), labels.to(self.device)

    def launch(self, batch: Any) -> None:
        """The launch phase alone: the ops a forward and backward would queue."""
        images, labels = batch
        x = images.flatten()[:64].float() + labels[:1]  # the batch is read, as the copy would
        for i in range(self.launch_ops):
            w = self._weights[i % len(self._weights)]  # the Python between two launches
            x = torch.mul(x, w) if i % 2 else torch.add(x, w, alpha=-0.5)

    def __call__(self, batch: Any) -> float:
        start = time.perf_counter()
        self.launch(batch)
        launched = time.perf_counter() - start
        if (wait := self.device_s - (time.perf_counter() - start)) > 0:
            time.sleep(wait)  # the device's time: no GIL held, no core used
        return launched
