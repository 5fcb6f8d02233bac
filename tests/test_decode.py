"""DecodeJPEG on the CPU, and RandomResizedCrop on the list of images it gives.

On the CPU the decoder is PIL: the images are PIL's, exactly, for every kind of file. The
pipeline DecodeJPEG -> RandomResizedCrop(antialias=True) gives what PIL's own crop and resize
give with the same boxes, within PIL's rounding. The GPU decoder's tests are marked ``cuda``;
its streams are tested on the simulated CUDA (``test_decode_simulated.py``).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same_batches, wait_until
from PIL import Image
from torch.utils.data import DataLoader, default_collate

import nostall
from nostall import transforms as T
from nostall.transforms import _decode


def _pixels(h: int, w: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    # Smooth enough that JPEG keeps the picture, noisy enough that crops differ.
    smooth = torch.nn.functional.avg_pool2d(noise.permute(2, 0, 1).float()[None], 3, 1, 1)
    return Image.frombytes(
        "RGB", (w, h), bytes(smooth[0].permute(1, 2, 0).byte().flatten().tolist())
    )


def _encoded(image: Image.Image, **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, **save)
    return out.getvalue()


KINDS: dict[str, Any] = {
    "baseline JPEG": lambda im: _encoded(im, format="JPEG", quality=90),
    "progressive JPEG": lambda im: _encoded(im, format="JPEG", progressive=True),
    "greyscale JPEG": lambda im: _encoded(im.convert("L"), format="JPEG"),
    "CMYK JPEG": lambda im: _encoded(im.convert("CMYK"), format="JPEG"),
    "PNG": lambda im: _encoded(im, format="PNG"),
}


def _pil_rgb(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as image:
        rgb = image.convert("RGB")
    pixels = torch.tensor(list(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(rgb.size[1], rgb.size[0], 3).permute(2, 0, 1)


def test_every_kind_of_file_decodes_to_pils_rgb() -> None:
    """JPEG (baseline, progressive, greyscale, CMYK) and PNG: PIL's RGB pixels, exactly."""
    files = [make(_pixels(18 + i, 23 - i, i)) for i, make in enumerate(KINDS.values())]
    decoded = T.DecodeJPEG()(T.collate_encoded(files))
    assert isinstance(decoded, list)
    assert len(decoded) == len(files)
    for kind, data, image in zip(KINDS, files, decoded, strict=True):
        assert image.dtype == torch.uint8, kind
        assert image.shape[0] == 3, kind
        assert torch.equal(image, _pil_rgb(data)), kind


BAD = {
    "corrupt": b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4,
    "truncated": KINDS["baseline JPEG"](_pixels(40, 40, 0))[:300],
    "empty": b"",
    "text": b"not an image at all",
}


@pytest.mark.parametrize("kind", list(BAD))
def test_an_unreadable_file_is_named_with_the_fix(kind: str) -> None:
    good = T.EncodedImage(KINDS["baseline JPEG"](_pixels(8, 8, 1)), "ok.jpg")
    batch = T.collate_encoded([good, T.EncodedImage(BAD[kind], f"bad/{kind}.jpg")])
    with pytest.raises(
        nostall.ImageDecodeError, match=f"image 1 of the batch \\(bad/{kind}.jpg\\)"
    ) as e:
        T.DecodeJPEG()(batch)
    assert e.value.index == 1
    assert e.value.name == f"bad/{kind}.jpg"
    assert "not a readable image" in str(e.value)
    fix = "LOAD_TRUNCATED_IMAGES" if kind == "truncated" else "remove it from the dataset"
    assert fix in str(e.value)
    assert isinstance(e.value, ValueError)
    assert e.value.__cause__ is not None  # PIL's own error, kept


def _folder(root: Path, bad: int | None = None, count: int = 10) -> Path:
    """One class folder of JPEGs of a few sizes; file ``bad`` truncated."""
    (root / "a").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        data = KINDS["baseline JPEG"](_pixels(30 + 3 * (i % 3), 40 - 2 * (i % 4), i))
        (root / "a" / f"{i:02d}.jpg").write_bytes(data[:200] if i == bad else data)
    return root


def _loader(root: Path, batch_size: int = 2) -> DataLoader[Any]:
    return DataLoader(T.ImageBytes(root), batch_size=batch_size, collate_fn=T.collate_encoded)


def _pipeline(**crop: Any) -> T.Compose:
    return T.Compose(
        [
            T.DecodeJPEG(),
            T.RandomResizedCrop(16, seed=3, **crop),
            T.RandomHorizontalFlip(seed=4),
            T.Normalize([0.5] * 3, [0.25] * 3),
        ]
    )


def test_the_epoch_goes_on_after_an_unreadable_file(tmp_path: Path) -> None:
    """As with any sample's error: the batches before it intact, the error, then the rest."""
    root = _folder(tmp_path, bad=3, count=8)
    got: list[Any] = []
    it = iter(nostall.prefetch(_loader(root), "cpu", transform=_pipeline()))
    while True:
        try:
            got.append(next(it)[1].tolist())
        except StopIteration:
            break
        except nostall.ImageDecodeError as e:
            got.append(e.name)
    assert got == [[0, 0], str(root / "a" / "03.jpg"), [0, 0], [0, 0]]


def test_the_pipeline_repeats_itself_and_resumes_mid_epoch(tmp_path: Path) -> None:
    """The same seeds give the same batches; a checkpoint resumes the crops and flips exactly."""
    root = _folder(tmp_path)
    expected = list(nostall.prefetch(_loader(root), "cpu", transform=_pipeline()))
    assert_same_batches(expected, nostall.prefetch(_loader(root), "cpu", transform=_pipeline()))
    p = nostall.prefetch(_loader(root), "cpu", depth=3, transform=_pipeline())
    it = iter(p)
    for i in range(2):
        assert torch.equal(next(it)[0], expected[i][0])
    puller = it._puller
    assert puller is not None
    wait_until(lambda: puller.pulled >= 4, "the producer transformed ahead")
    state = p.state_dict()
    p.close()
    resumed = nostall.prefetch(_loader(root), "cpu", transform=_pipeline())
    resumed.load_state_dict(state)
    assert_same_batches(expected[2:], resumed)


def test_the_crops_are_pils_crops_with_the_same_boxes(tmp_path: Path) -> None:
    """With antialias=True: PIL's crop and bilinear resize of the same box, within rounding.

    PIL resizes in fixed point and rounds to 8 bits between its two passes: a few levels
    apart at most, a fraction of a level on average.
    """
    root = _folder(tmp_path, count=6)
    paths = [p for p, _ in T.ImageBytes(root).samples]
    crop = T.RandomResizedCrop(24, seed=7, antialias=True)
    images = T.DecodeJPEG()(next(iter(_loader(root, 6)))[0])
    start = crop.generator.get_state()
    out = crop(images)
    crop.generator.set_state(start)
    for i, image in enumerate(images):
        top, left, h, w = (int(v) for v in crop.boxes(1, *image.shape[-2:])[0].tolist())
        with Image.open(paths[i]) as source:
            box = (left, top, left + w, top + h)  # torchvision's resized_crop on PIL images
            ref = source.convert("RGB").crop(box).resize((24, 24), Image.Resampling.BILINEAR)
        want = (
            torch.tensor(list(ref.tobytes()), dtype=torch.float32).view(24, 24, 3).permute(2, 0, 1)
        )
        diff = ((out[i] * 255).round() - want).abs()
        assert float(diff.max()) <= 8, (i, float(diff.max()))
        assert float(diff.mean()) < 0.5, (i, float(diff.mean()))


def test_the_centre_crops_are_resize_then_center_crop_on_pil_images(tmp_path: Path) -> None:
    """torchvision's evaluation pipeline on PIL images (Resize, CenterCrop), within rounding."""
    root = _folder(tmp_path, count=6)
    paths = [p for p, _ in T.ImageBytes(root).samples]
    images = T.DecodeJPEG()(next(iter(_loader(root, 6)))[0])
    out = T.ResizedCenterCrop(24, resize=28)(images)
    assert out.shape == (6, 3, 24, 24)
    for i, image in enumerate(images):
        h, w = image.shape[-2:]
        size = (28, int(28 * h / w)) if w <= h else (int(28 * w / h), 28)  # PIL's (w, h)
        with Image.open(paths[i]) as source:
            resized = source.convert("RGB").resize(size, Image.Resampling.BILINEAR)
        left, top = round((size[0] - 24) / 2), round((size[1] - 24) / 2)
        ref = resized.crop((left, top, left + 24, top + 24))
        want = torch.tensor(list(ref.tobytes()), dtype=torch.float32).view(24, 24, 3)
        diff = ((out[i] * 255).round() - want.permute(2, 0, 1)).abs()
        assert float(diff.max()) <= 8, (i, float(diff.max()))
        assert float(diff.mean()) < 0.5, (i, float(diff.mean()))


def test_a_centre_crop_of_a_batch_and_of_its_list_agree_and_small_images_are_padded() -> None:
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (3, 3, 20, 30), dtype=torch.uint8, generator=g)
    crop = T.ResizedCenterCrop(16)  # resize: round(16 * 256 / 224) = 18
    assert crop.resize == 18
    assert "resize=18" in repr(crop)
    torch.testing.assert_close(crop(batch), T.ResizedCenterCrop(16, on=None)(list(batch)))
    padded = T.ResizedCenterCrop(12, resize=6)(torch.ones(1, 3, 6, 6))
    assert float(padded[0, :, 3:9, 3:9].min()) == 1.0
    assert float(padded[0, :, :3].max()) == 0.0
    with pytest.raises(ValueError, match="resize=256 with size=224"):
        T.ResizedCenterCrop(224, resize=0)
    with pytest.raises(TypeError, match="antialias"):
        T.ResizedCenterCrop(224, antialias="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("antialias", [False, True])
def test_a_list_of_images_of_one_size_crops_as_their_batch(antialias: bool) -> None:
    """The boxes are drawn image after image, as for a batch: the same numbers."""
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (4, 3, 20, 30), dtype=torch.uint8, generator=g)
    as_batch = T.RandomResizedCrop(10, seed=1, antialias=antialias)(batch)
    as_list = T.RandomResizedCrop(10, seed=1, antialias=antialias, on=None)(list(batch))
    torch.testing.assert_close(as_list, as_batch, atol=1e-6, rtol=0)


def test_a_bare_batch_of_decoded_images_is_one_part() -> None:
    """DecodeJPEG's list is the images, not a batch of parts, for every transform after it."""
    files = [KINDS["baseline JPEG"](_pixels(12 + i, 14, i)) for i in range(3)]
    pipeline = T.Compose([T.DecodeJPEG(), T.RandomResizedCrop(8)])
    assert pipeline(T.collate_encoded(files)).shape == (3, 3, 8, 8)
    on_key = T.Compose([T.DecodeJPEG(on="image"), T.RandomResizedCrop(8, on="image")])
    labelled = on_key({"image": T.collate_encoded(files), "label": torch.arange(3)})
    assert labelled["image"].shape == (3, 3, 8, 8)
    assert labelled["label"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    ("kind", "taken"),
    [
        ("baseline JPEG", True),
        ("progressive JPEG", True),
        ("greyscale JPEG", True),
        ("CMYK JPEG", False),
        ("PNG", False),
    ],
)
def test_only_jpegs_of_one_or_three_components_go_to_the_gpus_decoder(
    kind: str, taken: bool
) -> None:
    """CMYK JPEGs go to PIL: a GPU decoder may refuse them or give other colours silently."""
    data = torch.tensor(list(KINDS[kind](_pixels(9, 11, 0))), dtype=torch.uint8)
    assert taken == _decode._gpu_decodable(data)
    assert not _decode._gpu_decodable(data[:40])  # cut before its frame header
    assert not _decode._gpu_decodable(torch.zeros(0, dtype=torch.uint8))


def _patched(data: bytes, at: int, value: int) -> torch.Tensor:
    """``data`` with the byte at ``at`` past its frame marker (FF C0) set to ``value``."""
    frame = data.index(b"\xff\xc0")
    patched = bytearray(data)
    patched[frame + at] = value
    return torch.tensor(list(patched), dtype=torch.uint8)


def test_other_kinds_of_jpeg_go_to_pil_and_long_headers_are_read() -> None:
    """Lossless, arithmetic-coded or 12-bit frames are not the GPU's; 300 KB of EXIF is read."""
    data = KINDS["baseline JPEG"](_pixels(9, 11, 0))
    assert _decode._gpu_decodable(_patched(data, 1, 0xC0))
    for marker in (0xC3, 0xC9, 0xCA, 0xC5):
        assert not _decode._gpu_decodable(_patched(data, 1, marker)), hex(marker)
    assert not _decode._gpu_decodable(_patched(data, 4, 12))  # 12 bits a sample
    app = b"\xff\xe1" + (65533).to_bytes(2, "big") + bytes(65531)  # a full APP1 segment
    long_header = data[:2] + app * 5 + data[2:]
    assert len(long_header) > 300_000
    assert _decode._gpu_decodable(torch.tensor(list(long_header), dtype=torch.uint8))
    assert torch.equal(T.DecodeJPEG()(T.collate_encoded([long_header]))[0], _pil_rgb(data))


def test_compose_on_a_part_takes_what_its_first_transform_takes() -> None:
    """Keyed batch objects are indexed; decoded images can be the part; functions get tensors."""

    class Keyed:  # a batch with __getitem__ and __setitem__, not a Mapping (as PyG's Data)
        def __init__(self, image: torch.Tensor) -> None:
            self.fields = {"image": image}

        def __getitem__(self, key: str) -> torch.Tensor:
            return self.fields[key]

        def __setitem__(self, key: str, value: torch.Tensor) -> None:
            self.fields[key] = value

        def __copy__(self) -> Keyed:
            return Keyed(self.fields["image"])

    x = torch.rand(2, 3, 4, 4)
    out = T.Compose([T.Normalize([0.5] * 3, [0.5] * 3)], on="image")(Keyed(x))
    assert torch.equal(out["image"], x * 2 - 1)
    files = T.collate_encoded([KINDS["baseline JPEG"](_pixels(10 + i, 12, i)) for i in range(2)])
    decoded = T.DecodeJPEG()(files)
    crop = T.Compose([T.RandomResizedCrop(8), T.Normalize([0.5] * 3, [0.5] * 3)], on=0)
    assert crop((decoded, torch.arange(2)))[0].shape == (2, 3, 8, 8)
    assert crop(decoded).shape == (2, 3, 8, 8)  # a bare list of decoded images is the part
    with pytest.raises(ValueError, match="needs a tensor there"):
        T.Compose([lambda v: v], on=0)((5, x))
    plain = list(decoded)  # a plain list at the part: images, never a batch of parts
    assert crop((plain, torch.arange(2)))[0].shape == (2, 3, 8, 8)
    with pytest.raises(ValueError, match="the encoded images are at index 0: pass on=0"):
        T.DecodeJPEG(on=None)((files, torch.arange(2)))


def test_wrong_arguments_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="decoder='auto'"):
        T.DecodeJPEG(decoder="gpu")
    with pytest.raises(TypeError, match="read files with ImageBytes"):
        T.DecodeJPEG().apply(torch.zeros(3))
    with pytest.raises(ValueError, match=r"DecodeJPEG\(on=0\) needs an EncodedImages batch there"):
        T.DecodeJPEG()((torch.zeros(3), torch.zeros(3)))
    # The mistakes a first try makes, each with its fix.
    samples = [(KINDS["baseline JPEG"](_pixels(8, 8, i)), i) for i in range(2)]
    uncollated = default_collate(samples)  # the DataLoader's default collate
    with pytest.raises(ValueError, match=r"pass collate_fn=T\.collate_encoded"):
        T.DecodeJPEG()(uncollated)
    with pytest.raises(ValueError, match=r"put T.DecodeJPEG\(\) before this transform"):
        T.Compose([T.RandomResizedCrop(8), T.DecodeJPEG()])(T.collate_encoded(samples))
    with pytest.raises(ValueError, match=r"ResizedCenterCrop\(on=0\).*put T.DecodeJPEG"):
        T.ResizedCenterCrop(8)(T.collate_encoded(samples))
    keyed = T.collate_encoded([{"image": data, "label": y} for data, y in samples])
    with pytest.raises(ValueError, match="its keys: 'image', 'label'"):
        T.DecodeJPEG()(keyed)
    with pytest.raises(ValueError, match="decodes on CUDA, and this batch goes to cpu"):
        T.DecodeJPEG(decoder="nvjpeg")(T.collate_encoded(samples)[0])
    with pytest.raises(ValueError, match="item 1 has shape"):
        T.RandomResizedCrop(8, on=None)([torch.zeros(3, 9, 9), torch.zeros(1, 9, 9)])
    with pytest.raises(TypeError, match="antialias"):
        T.RandomResizedCrop(8, antialias=1)  # type: ignore[arg-type]


def test_a_decoder_of_yours_decodes_on_the_cpu_too() -> None:
    """A function given as decoder= is called wherever the batch goes, PIL for what it refuses."""
    calls: list[int] = []

    def mine(buffers: Any, device: torch.device) -> list[torch.Tensor]:
        calls.append(len(buffers))
        if len(buffers) > 1:
            raise RuntimeError("one at a time")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8, device=device)]

    files = [KINDS["baseline JPEG"](_pixels(8, 8, i)) for i in range(2)] + [
        KINDS["PNG"](_pixels(5, 5, 0))
    ]
    out = T.DecodeJPEG(decoder=mine)(T.collate_encoded(files))
    assert calls == [2, 1, 1]  # the batch refused, then each JPEG alone; the PNG to PIL
    assert [tuple(i.shape) for i in out] == [(3, 2, 2), (3, 2, 2), (3, 5, 5)]


def test_a_decode_transform_pickles() -> None:
    """As every transform, it goes to spawned processes (its stream and lock are not kept)."""
    import pickle

    back = pickle.loads(pickle.dumps(T.DecodeJPEG(decoder="pil", on="jpeg")))
    assert back.decoder == "pil"
    assert back.on == "jpeg"
    assert "decoder='pil'" in repr(back)


requires_nvjpeg = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("NOSTALL_NO_TORCHVISION") == "1",
    reason="needs a GPU and torchvision",
)


@pytest.mark.cuda
@requires_nvjpeg
def test_nvjpeg_decodes_within_a_level_or_two_of_pil(tmp_path: Path) -> None:
    """On a GPU: nvJPEG's images (the PNG and the CMYK JPEG go to PIL) close to PIL's."""
    pytest.importorskip("torchvision")
    files = [make(_pixels(64 + i, 80 - i, i)) for i, make in enumerate(KINDS.values())]
    decoded = T.DecodeJPEG()(T.collate_encoded(files).to("cuda"))
    for kind, data, image in zip(KINDS, files, decoded, strict=True):
        assert image.is_cuda, kind
        diff = (image.cpu().float() - _pil_rgb(data).float()).abs()
        # torchvision's own test of nvJPEG against its CPU decoder: under 2 levels on average
        # (the decoders' IDCT and chroma upsampling differ, most at sharp edges).
        assert float(diff.mean()) < 2.0, (kind, float(diff.mean()))


@pytest.mark.cuda
@requires_nvjpeg
def test_nvjpeg_pipeline_on_the_prefetcher_matches_the_cpu(tmp_path: Path) -> None:
    """The whole pipeline through nostall.prefetch on CUDA, against the CPU's numbers."""
    pytest.importorskip("torchvision")
    root = _folder(tmp_path, count=12)
    cpu = list(nostall.prefetch(_loader(root, 4), "cpu", transform=_pipeline(antialias=True)))
    gpu = list(nostall.prefetch(_loader(root, 4), "cuda", transform=_pipeline(antialias=True)))
    for (a, la), (b, lb) in zip(cpu, gpu, strict=True):
        assert torch.equal(la, lb.cpu())
        assert float((a - b.cpu()).abs().mean()) < 0.1  # normalised units: decoders differ a little
