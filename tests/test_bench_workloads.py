"""The bench's workloads: synthetic images, JPEG files decoded with PIL, the training step."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nostall.bench._workloads import (
    DeviceStep,
    JpegImages,
    SyntheticImages,
    jpeg_files,
    train_step,
)

pytest.importorskip("PIL")


def test_synthetic_images_are_a_function_of_the_index() -> None:
    """Same index, same sample, on any call; pixels vary within an image and across indices."""
    data = SyntheticImages(5, size=6, decode_ms=0.01)
    image, label = data[3]
    assert (3, 6, 6) == tuple(image.shape)
    assert torch.uint8 == image.dtype
    assert torch.equal(image, data[3][0])
    assert 3 == label
    assert len(torch.unique(image)) > 1
    assert not torch.equal(data[0][0], data[1][0])


def test_jpeg_files_are_made_once_and_reused(tmp_path: Path) -> None:
    """The files are made on the first call, kept, and not rewritten; none is half-written."""
    paths = jpeg_files(str(tmp_path), 3)
    assert [tmp_path / f"{i:06d}.jpg" for i in range(3)] == paths
    stamps = [os.stat(p).st_mtime_ns for p in paths]
    assert stamps == [os.stat(p).st_mtime_ns for p in jpeg_files(str(tmp_path), 3)]
    assert not list(tmp_path.glob("*.part"))
    assert all(p.stat().st_size > 5_000 for p in paths)  # photograph-like, not flat colour


def test_jpeg_folder_defaults_to_the_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a folder the files go to $XDG_CACHE_HOME/nostall/bench-jpeg."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    (path,) = jpeg_files(None, 1)
    assert tmp_path / "nostall" / "bench-jpeg" / "000000.jpg" == path


def test_jpeg_samples_are_decoded_cropped_and_resized(tmp_path: Path) -> None:
    """CHW uint8 at the asked size, the same for an index on every call, crops differ."""
    data = JpegImages(jpeg_files(str(tmp_path), 4), size=24)
    image, label = data[2]
    assert (3, 24, 24) == tuple(image.shape)
    assert torch.uint8 == image.dtype
    assert 2 == label
    assert torch.equal(image, data[2][0])
    assert not torch.equal(data[0][0], data[1][0])


def test_train_step_trains() -> None:
    """A step returns the loss and changes the loss on the same batch (the model learns)."""
    step = train_step(4, torch.device("cpu"))
    batch = (torch.randint(0, 255, (8, 3, 16, 16), dtype=torch.uint8), torch.arange(8) % 10)
    first = step(batch)
    assert isinstance(first, float)
    assert first != step(batch)


def test_jpeg_images_cycle_over_the_files_to_the_length_asked(tmp_path: Path) -> None:
    """A length past the files repeats them: every index up to the length reads a file."""
    data = JpegImages(jpeg_files(str(tmp_path), 2), size=16, length=5)
    assert 5 == len(data)
    image, label = data[4]
    assert (3, 16, 16) == tuple(image.shape)
    assert 4 == label


def test_device_step_waits_out_the_device_time_and_returns_the_launch() -> None:
    """A step lasts at least its device time; it returns the launch phase, shorter than that."""
    import time

    step = DeviceStep(launch_ops=10, device_s=0.05)
    batch = (torch.zeros(4, 3, 8, 8, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))
    start = time.perf_counter()
    launched = step(batch)
    assert time.perf_counter() - start >= 0.05
    assert 0 < launched


def test_device_step_waits_without_the_gil() -> None:
    """While one thread waits for "the device", another thread runs Python."""
    import threading

    step = DeviceStep(launch_ops=1, device_s=20.0)
    batch = (torch.zeros(1, 1, 8, 8, dtype=torch.uint8), torch.zeros(1, dtype=torch.int64))
    waiting = threading.Thread(target=step, args=(batch,), daemon=True)
    waiting.start()
    counted = sum(1 for _ in range(100_000))  # long before the 20 s wait ends
    assert 100_000 == counted
    assert waiting.is_alive()
