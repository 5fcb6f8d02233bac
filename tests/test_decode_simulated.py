"""DecodeJPEG on the simulated CUDA (``tests/simcuda``): its streams, with a canary each.

Two test doubles stand for GPU decoders; both decode with PIL (so the values are exact) and
write the images on the device as a GPU decoder does:

* :class:`SyncDecoder`, as torchvision's ``decode_jpeg(..., device="cuda")``: the images are
  allocated on the current stream, written on the decoder's own stream, the host waits for
  that stream (``cudaStreamSynchronize``), and the current stream waits for an event of it;
* :class:`AsyncDecoder`: everything queued on the current stream, nothing waited for.

Each protection of :class:`nostall.transforms.DecodeJPEG` removed must be flagged: the decode
stream (without it the decoder's own stream writes memory the copy stream may still read),
the copy stream's wait for the decode stream, and ``record_stream`` of the images for it.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from simcuda import Kind, Simulation, simulated_cuda
from simcuda._simulation import active
from torch.utils.data import DataLoader

import nostall
from nostall import transforms as T
from nostall.transforms import _decode

SIZES = [(20, 24), (26, 18), (20, 24), (31, 29)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two classes of JPEGs of a few sizes (and one PNG, which nvJPEG does not take)."""
    root = tmp_path_factory.mktemp("images")
    g = torch.Generator().manual_seed(0)
    for label in ("a", "b"):
        (root / label).mkdir()
        for i in range(6):
            h, w = SIZES[i % len(SIZES)]
            pixels = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
            image = Image.frombytes("RGB", (w, h), bytes(pixels.flatten().tolist()))
            if label == "b" and i == 3:
                image.save(root / label / f"{i}.png")
            elif label == "a" and i == 4:
                image.save(root / label / f"{i}.jpg", progressive=True)
            else:
                image.save(root / label / f"{i}.jpg", quality=90)
    return root


def _host(buffer: torch.Tensor) -> torch.Tensor:
    """PIL's RGB pixels; a file it cannot read refused with a RuntimeError, as torchvision does."""
    try:
        with Image.open(io.BytesIO(bytes(buffer.tolist()))) as image:
            rgb = image.convert("RGB")
    except OSError as e:
        raise RuntimeError(f"Error while decoding JPEG images: {e}") from e
    pixels = torch.tensor(list(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(rgb.size[1], rgb.size[0], 3).permute(2, 0, 1).contiguous()


class SyncDecoder:
    """torchvision's way: allocate on the current stream, write on its own, wait for it."""

    def __init__(self) -> None:
        self.stream: Any = None
        self.calls = 0

    def __call__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        self.calls += 1
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(device)
        host = [_host(b) for b in buffers]
        out = [torch.empty(h.shape, dtype=torch.uint8, device=device) for h in host]
        with torch.cuda.stream(self.stream):
            for o, h in zip(out, host, strict=True):
                o.copy_(h.pin_memory(), non_blocking=True)
        active().library_sync(self.stream)  # its cudaStreamSynchronize
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(self.stream)
        current.wait_event(done)
        return out


class AsyncDecoder:
    """Queued on the current stream, returned at once."""

    def __call__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        return [_host(b).pin_memory().to(device, non_blocking=True) for b in buffers]


class RefusingDecoder(SyncDecoder):
    """Refuses a batch holding a progressive JPEG (as a decoder may refuse a kind of file)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused = 0

    def __call__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        if any(b"\xff\xc2" in bytes(b.tolist()) for b in buffers):  # a progressive frame
            self.refused += 1
            raise RuntimeError("unsupported JPEG")
        return super().__call__(buffers, device)


def _pipeline(decoder: Any) -> T.Compose:
    return T.Compose(
        [
            T.DecodeJPEG(decoder=decoder),
            T.RandomResizedCrop(12, seed=3),
            T.RandomHorizontalFlip(seed=4),
        ]
    )


def _loader(folder: Path) -> DataLoader[Any]:
    return DataLoader(T.ImageBytes(folder), batch_size=3, collate_fn=T.collate_encoded)


def _model(batch: Any) -> torch.Tensor:
    images, labels = batch
    out: torch.Tensor = images.float().sum((1, 2, 3)) * 2 + labels
    return out


def _consume(sim: Simulation, batches: Any, consumer: str) -> list[torch.Tensor]:
    stream = torch.cuda.Stream() if consumer == "side" else None  # type: ignore[no-untyped-call]
    outs = []
    with torch.cuda.stream(stream):
        for batch in batches:
            with sim.model_work():
                outs.append(_model(batch))
    torch.cuda.synchronize()
    return [o.cpu() for o in outs]


def _expected(folder: Path) -> list[torch.Tensor]:
    pipeline = _pipeline("pil")
    return [_model(pipeline(b)) for b in _loader(folder)]


@pytest.fixture
def sim() -> Iterator[Simulation]:
    with simulated_cuda() as s:
        yield s


@pytest.mark.parametrize("threads", [None, 2])
@pytest.mark.parametrize("consumer", ["default", "side"])
@pytest.mark.parametrize("kind", [SyncDecoder, AsyncDecoder])
def test_decoded_on_the_copy_stream_without_a_hazard(
    sim: Simulation, folder: Path, kind: type, consumer: str, threads: int | None
) -> None:
    """The values of the CPU pipeline; no missing wait, no reuse, no wait for the model.

    Without a timeout the consumer may stage a batch itself; with threads= the files are read
    by loading threads: the decode runs in whichever thread stages the batch.
    """
    decoder = kind()
    pipeline = _pipeline(decoder)
    batches = nostall.prefetch(_loader(folder), "cuda", transform=pipeline, threads=threads)
    got = _consume(sim, batches, consumer)
    want = _expected(folder)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert [] == sim.hazards
    if isinstance(decoder, SyncDecoder):
        assert decoder.calls == 4  # the PNG went to PIL; each batch decoded in one call


def test_a_refused_image_is_decoded_on_the_host(sim: Simulation, folder: Path) -> None:
    """A decoder that refuses a batch: each image alone, the refused one by PIL, then copied."""
    decoder = RefusingDecoder()
    batches = nostall.prefetch(_loader(folder), "cuda", transform=_pipeline(decoder), timeout=30.0)
    got = _consume(sim, batches, "side")
    for g, w in zip(got, _expected(folder), strict=True):
        torch.testing.assert_close(g, w)
    assert decoder.refused == 2  # its batch, then the image alone
    assert decoder.calls == 4 - 1 + 2  # the other batches at once, the rest of that one alone
    assert [] == sim.hazards


def test_an_unreadable_file_on_the_gpu_is_named(sim: Simulation, tmp_path: Path) -> None:
    """Refused by the GPU's decoder and by PIL: ImageDecodeError, as on the CPU.

    A batch of such files only (each refused alone too) names the first, rather than taking
    the decoder for a broken one.
    """
    (tmp_path / "a").mkdir()
    data = io.BytesIO()
    Image.effect_noise((16, 16), 40).convert("RGB").save(data, "JPEG")
    for name in ("bad.jpg", "bad2.jpg"):  # a valid frame header, then no image data
        (tmp_path / "a" / name).write_bytes(data.getvalue()[:400])
    batches = nostall.prefetch(_loader(tmp_path), "cuda", transform=_pipeline(SyncDecoder()))
    with pytest.raises(nostall.ImageDecodeError, match=r"bad\.jpg"):
        next(iter(batches))
    assert [] == sim.hazards


class Recording(SyncDecoder):
    """Records the number of colour components of every file it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[str] = []

    def __call__(self, buffers: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        for b in buffers:
            with Image.open(io.BytesIO(bytes(b.tolist()))) as image:
                self.modes.append(image.mode)
        return super().__call__(buffers, device)


def test_cmyk_jpegs_and_other_files_never_reach_the_gpus_decoder(
    sim: Simulation, tmp_path: Path
) -> None:
    """A CMYK JPEG and a PNG go to PIL (same pixels as on the CPU); the rest to the decoder."""
    (tmp_path / "a").mkdir()
    for i, mode in enumerate(("RGB", "CMYK", "L", "RGB")):
        image = Image.effect_noise((12 + i, 10), 40).convert(mode)
        image.save(tmp_path / "a" / (f"{i}.png" if i == 3 else f"{i}.jpg"))
    decoder = Recording()
    batches = nostall.prefetch(_loader(tmp_path), "cuda", transform=_pipeline(decoder))
    got = _consume(sim, batches, "side")
    for g, w in zip(got, _expected(tmp_path), strict=True):
        torch.testing.assert_close(g, w)
    assert decoder.modes == ["RGB", "L"]
    assert [] == sim.hazards


def test_a_decoder_that_cannot_run_is_not_replaced_by_the_cpu(
    sim: Simulation, folder: Path
) -> None:
    """torchvision missing, or the GPU out of memory: the error, not a silent CPU decode."""

    def out_of_memory(buffers: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        next(iter(nostall.prefetch(_loader(folder), "cuda", transform=_pipeline(out_of_memory))))
    # torchvision's words for a decoder that cannot run, in a plain RuntimeError.
    for words in (
        "Error while decoding JPEG images: CUDA out of memory. Tried to allocate 2.00 MiB",
        "decode_jpegs_cuda: torchvision not compiled with nvJPEG support",
    ):

        def broken(buffers: Sequence[torch.Tensor], device: torch.device, w: str = words) -> Any:
            raise RuntimeError(w)

        batches = nostall.prefetch(_loader(folder), "cuda", transform=_pipeline(broken))
        with pytest.raises(RuntimeError) as raised:
            next(iter(batches))
        assert str(raised.value) == words  # itself, not retried image by image

    def refuses_all(buffers: Sequence[torch.Tensor], device: torch.device) -> Any:
        raise RuntimeError("Error while decoding JPEG images: unknown failure")

    batches = nostall.prefetch(_loader(folder), "cuda", transform=_pipeline(refuses_all))
    with pytest.raises(RuntimeError, match="refused each of the batch's 3 JPEGs, one by one"):
        next(iter(batches))
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        batches = nostall.prefetch(_loader(folder), "cuda", transform=_pipeline("nvjpeg"))
        with pytest.raises(ImportError, match="pip install torchvision"):
            next(iter(batches))


def test_encoded_batches_stay_on_the_host_without_a_warning(sim: Simulation, folder: Path) -> None:
    """Without a transform the consumer gets the bytes, on the host, to decode on cuda:0.

    The canary: without ``read_on_host`` the staging warns that tensors are hidden from it.
    """
    import warnings

    for marked in (True, False):
        with pytest.MonkeyPatch.context() as m, warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if not marked:
                m.setattr(T.EncodedImages, "read_on_host", False)
            batches = list(nostall.prefetch(_loader(folder), "cuda", timeout=30.0))
        hidden = [w for w in seen if "cannot find all the tensors" in str(w.message)]
        if marked:
            assert [] == hidden
            encoded = batches[0][0]
            assert isinstance(encoded, T.EncodedImages)
            assert encoded.device == torch.device("cuda", 0)
            assert encoded.data.device.type == "cpu"
            assert encoded.data.is_pinned()
            assert batches[0][1].is_cuda
        else:
            assert hidden, "without read_on_host the staging should have warned"
    assert [] == sim.hazards


def _caller_stream(self: T.DecodeJPEG, device: torch.device, caller: Any) -> Any:
    return caller


CANARIES = [
    # (what is removed, attribute of _decode or DecodeJPEG, replacement, decoder, hazard)
    ("the decode stream", "_stream", _caller_stream, SyncDecoder, Kind.REUSE),
    (
        "the copy stream's wait",
        "_follow",
        lambda caller, stream: None,
        AsyncDecoder,
        Kind.UNORDERED,
    ),
    (
        "record_stream for the copy stream",
        "_keep",
        lambda images, caller: None,
        AsyncDecoder,
        Kind.REUSE,
    ),
    (
        "record_stream for the copy stream",
        "_keep",
        lambda images, caller: None,
        SyncDecoder,
        Kind.REUSE,
    ),
]


@pytest.mark.parametrize(
    ("removed", "name", "replacement", "kind", "hazard"),
    CANARIES,
    ids=[f"{c[0]}-{c[3].__name__}" for c in CANARIES],
)
def test_canary(
    sim: Simulation,
    monkeypatch: pytest.MonkeyPatch,
    folder: Path,
    removed: str,
    name: str,
    replacement: Any,
    kind: type,
    hazard: Kind,
) -> None:
    """Each protection removed is seen by the simulation."""
    owner: Any = T.DecodeJPEG if name == "_stream" else _decode
    monkeypatch.setattr(owner, name, replacement)
    batches = nostall.prefetch(_loader(folder), "cuda", transform=_pipeline(kind()), timeout=30.0)
    _consume(sim, batches, "side")
    assert hazard in sim.kinds(), f"removing {removed} went unseen: {sim.hazards}"
