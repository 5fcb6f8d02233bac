"""Encoded images: ImageBytes reads files as they are, collate_encoded packs a batch's bytes."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, default_collate

from nostall import transforms as T


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Class folders b/ and a/ (scanned sorted), a file of another kind, a nested folder."""
    for label, count in (("b", 2), ("a", 3)):
        (tmp_path / label).mkdir()
        for i in range(count):
            Image.new("RGB", (8 + i, 6), (i * 40, 10, 200)).save(tmp_path / label / f"{i}.jpg")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "a" / "deeper").mkdir()
    Image.new("L", (5, 5), 7).save(tmp_path / "a" / "deeper" / "x.PNG")
    return tmp_path


def test_a_folder_reads_as_image_folder_does(folder: Path) -> None:
    """Classes sorted, files sorted and found below each class folder, other files left out."""
    data = T.ImageBytes(folder)
    assert data.classes == ["a", "b"]
    assert data.class_to_idx == {"a": 0, "b": 1}
    names = [Path(p).relative_to(folder).as_posix() for p, _ in data.samples]
    assert names == ["a/0.jpg", "a/1.jpg", "a/2.jpg", "a/deeper/x.PNG", "b/0.jpg", "b/1.jpg"]
    assert data.targets == [0, 0, 0, 0, 1, 1]
    image, target = data[4]
    assert isinstance(image, T.EncodedImage)
    assert bytes(image) == (folder / "b" / "0.jpg").read_bytes()
    assert image.name == str(folder / "b" / "0.jpg")
    assert target == 1
    assert len(data) == 6
    assert "6 files, 2 classes" in repr(data)


def test_a_folder_under_home_is_found(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """``~`` is expanded, as ImageFolder expands it."""
    monkeypatch.setenv("HOME", str(folder.parent))
    assert len(T.ImageBytes(f"~/{folder.name}")) == 6


def test_files_come_in_image_folders_order(tmp_path: Path) -> None:
    """Folders walked as torchvision's ImageFolder walks them: indices mean the same images."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "linked.jpg").write_bytes(b"4")
    root = tmp_path / "root"
    (root / "b" / "b_sub").mkdir(parents=True)
    for name in ("c.jpg", "B.jpg", "a.jpg", "b_sub/x.jpg"):
        (root / "b" / name).write_bytes(b"1")
    (root / "b" / "zlink").symlink_to(elsewhere, target_is_directory=True)
    names = [Path(p).relative_to(root).as_posix() for p, _ in T.ImageBytes(root).samples]
    # os.walk(followlinks=True), sorted: the folder's files, then each subfolder's.
    assert names == ["b/B.jpg", "b/a.jpg", "b/c.jpg", "b/b_sub/x.jpg", "b/zlink/linked.jpg"]


def test_a_dataset_with_samples_or_a_list_of_paths(folder: Path) -> None:
    """torchvision's ImageFolder is read through .samples; lists of paths or pairs work."""

    class Folder:  # what torchvision's ImageFolder offers
        def __init__(self) -> None:
            self.samples = [(str(folder / "b" / "1.jpg"), 4)]
            self.classes = ["x", "y", "z", "u", "v"]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    data = T.ImageBytes(Folder())
    assert data.samples == [(str(folder / "b" / "1.jpg"), 4)]
    assert data.classes == Folder().classes
    assert data[0][1] == 4
    paths = [folder / "a" / "0.jpg", str(folder / "a" / "1.jpg")]
    assert T.ImageBytes(paths).targets == [0, 0]
    assert T.ImageBytes([(paths[0], 3)])[0][1] == 3


def test_bad_sources_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"ImageBytes\(source\).*got 3, an int"):
        T.ImageBytes(3)
    with pytest.raises(ValueError, match="found no directory"):
        T.ImageBytes(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="found no image files in class folders"):
        T.ImageBytes(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "0.jpg").write_bytes(b"0")
    with pytest.raises(ValueError, match="no image files for the classes empty under"):
        T.ImageBytes(tmp_path)
    assert T.ImageBytes(tmp_path, allow_empty=True).classes == ["empty", "full"]
    with pytest.raises(TypeError, match=r"source\[1\] is neither a path"):
        T.ImageBytes(["a.jpg", 5])


def test_an_encoded_image_pickles_with_its_name() -> None:
    image = T.EncodedImage(b"\xff\xd8\xff...", "cats/1.jpg")
    back = pickle.loads(pickle.dumps(image))
    assert back == image
    assert back.name == "cats/1.jpg"
    assert isinstance(back, T.EncodedImage)
    assert "cats/1.jpg" in repr(image)


def test_collate_packs_the_bytes_and_collates_the_rest_as_default_collate() -> None:
    samples = [
        (T.EncodedImage(b"abc", "x.jpg"), 1, torch.tensor([1.0, 2.0])),
        (T.EncodedImage(b"", "empty.jpg"), 0, torch.tensor([3.0, 4.0])),
        (T.EncodedImage(b"defgh", "y.jpg"), 2, torch.tensor([5.0, 6.0])),
    ]
    images, labels, values = T.collate_encoded(samples)
    assert isinstance(images, T.EncodedImages)
    assert len(images) == 3
    assert [bytes(b.tolist()) for b in images.buffers()] == [b"abc", b"", b"defgh"]
    assert bytes(images[-1].tolist()) == b"defgh"
    assert images.names == ("x.jpg", "empty.jpg", "y.jpg")
    assert images.offsets.tolist() == [0, 3, 3, 8]
    want = default_collate([(s[1], s[2]) for s in samples])
    assert torch.equal(labels, want[0])
    assert torch.equal(values, want[1])
    with pytest.raises(IndexError):
        images[3]


def test_collate_takes_dicts_and_every_bytes_like_type() -> None:
    samples = [{"jpeg": kind(b"\x01\x02"), "label": 1} for kind in (bytes, bytearray, memoryview)]
    batch = T.collate_encoded(samples)
    assert isinstance(batch["jpeg"], T.EncodedImages)
    assert batch["jpeg"].names == ("", "", "")
    assert batch["jpeg"].data.tolist() == [1, 2] * 3
    assert batch["label"].tolist() == [1, 1, 1]
    strided = memoryview(b"\x08\x00\x09\x00")[::2]  # not contiguous: copied first
    assert T.collate_encoded([strided]).data.tolist() == [8, 9]
    bare = T.collate_encoded([b"\x05", b"\x06\x07"])
    assert isinstance(bare, T.EncodedImages)
    assert bare.data.tolist() == [5, 6, 7]


def _shared(samples: list[Any]) -> bool:
    return bool(T.collate_encoded(samples)[0].data.is_shared())


def test_in_a_worker_the_bytes_are_packed_in_shared_memory(folder: Path) -> None:
    """As default_collate does: sending the batch to the main process copies nothing more."""
    loader = DataLoader(T.ImageBytes(folder), batch_size=3, num_workers=1, collate_fn=_shared)
    assert list(loader) == [True, True]
    assert not _shared([(b"ab", 0)])  # in this process: ordinary memory


def test_encoded_images_move_by_name_only(folder: Path) -> None:
    """.to() keeps the bytes on the host (decoders read them there) and records the device."""
    images, _ = next(
        iter(DataLoader(T.ImageBytes(folder), batch_size=2, collate_fn=T.collate_encoded))
    )
    moved = images.to("meta")
    assert moved.device == torch.device("meta")
    assert moved.data is images.data
    assert moved.names == images.names
    assert "for meta" in repr(moved)
    with pytest.raises(ValueError, match="one 1-D uint8 host tensor"):
        T.EncodedImages(torch.zeros(2, 2, dtype=torch.uint8), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="2 names for 1 images"):
        T.EncodedImages(torch.zeros(4, dtype=torch.uint8), torch.tensor([0, 4]), ["a", "b"])
