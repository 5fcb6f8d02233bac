"""DecodeJPEG: a batch of encoded images decoded where the batch goes (nvJPEG on a GPU).

Invariants:
    * Image ``i`` of the output is image ``i`` of the batch, decoded to RGB: a (3, H, W) uint8
      tensor on the batch's device (greyscale and CMYK images converted, as PIL's
      ``convert("RGB")`` does). EXIF orientation is not applied (neither torchvision's decoder
      nor PIL's ``open`` applies it).
    * On CUDA the decoder runs with the device's decode stream (one per device for the
      process, :class:`DecodeStreams`) as the current stream, so the images are allocated
      there; the stream that called (the copy stream, in a prefetcher) then waits for the
      decode stream, and each image is
      ``record_stream``-ed on it, so its memory is not reused while the transforms after the
      decode still read it. Nothing here waits for the model's stream.
    * torchvision's decoder makes the calling thread wait for its own stream (it ends with a
      ``cudaStreamSynchronize``): the producer thread waits for the decode, never the model.
      When it returns it has read the bytes.
    * An image the device's decoder does not take (not a JPEG, or one it refuses) is decoded
      by PIL on the host and copied to the device; one that PIL cannot read either raises
      :class:`~nostall.ImageDecodeError`, naming its position in the batch and its file.
"""

from __future__ import annotations

import ctypes
import io
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._exceptions import ImageDecodeError
from ..cuda._transfer import record_stream, upload
from ._base import Images, Key, Transform
from ._encoded import EncodedImages

#: A decoder: the images' bytes (1-D uint8 host tensors) and a device -> (C, H, W) uint8 images
#: there. On CUDA, when it returns, its work must be done or queued on the current stream, and
#: the bytes read (or read only by torch's copies from pinned memory, which torch keeps until
#: they have run): nothing here keeps the bytes alive after it returns.
Decoder = Callable[[Sequence[torch.Tensor], torch.device], Sequence[torch.Tensor]]

_DECODERS = ("auto", "nvjpeg", "pil")

#: The first bytes of every JPEG file (start of image, then a marker).
_JPEG_START = b"\xff\xd8\xff"


class DecodeJPEG(Transform):
    """Decode an :class:`~nostall.transforms.EncodedImages` batch on its device.

    Returns a list of (3, H, W) uint8 RGB images (their sizes differ), which
    :class:`RandomResizedCrop` turns into one batch. ``decoder`` is ``"auto"`` (nvJPEG through
    torchvision's ``decode_jpeg`` on CUDA, PIL elsewhere), ``"nvjpeg"``, ``"pil"``, or a
    callable taking the images' bytes (1-D uint8 host tensors) and the device and returning
    the images there.

    nvJPEG decodes a batch at once, on the hardware JPEG decoder where the GPU has one (A100,
    H100, H200) and on the GPU's cores elsewhere; images it does not take (PNG, ...) are
    decoded by PIL on the host and copied, one by one.
    """

    takes = "an EncodedImages batch"

    def __init__(self, *, decoder: str | Decoder = "auto", on: Key | None = 0) -> None:
        super().__init__(on)
        if not callable(decoder) and decoder not in _DECODERS:
            raise ValueError(
                f"DecodeJPEG(decoder=...) is one of {', '.join(map(repr, _DECODERS))} or a "
                f"function (got {decoder!r}); pass decoder='auto'"
            )
        self.decoder = decoder

    def accepts(self, part: object) -> bool:
        """An :class:`EncodedImages` batch."""
        return isinstance(part, EncodedImages)

    def fix_for(self, part: object) -> str:
        """Batch bytes with ``collate_encoded``; read files as bytes with ``ImageBytes``."""
        if isinstance(part, (list, tuple)) and part and isinstance(part[0], (bytes, bytearray)):
            return (
                "these are the images' bytes as the DataLoader's default collate leaves them: "
                "pass collate_fn=T.collate_encoded to the DataLoader"
            )
        if isinstance(part, (list, tuple)):
            where = [i for i, p in enumerate(part) if isinstance(p, EncodedImages)]
            if where:
                return f"the encoded images are at index {where[0]}: pass on={where[0]}"
        return "read the files with T.ImageBytes and pass collate_fn=T.collate_encoded"

    def apply(self, images: Any) -> Images:  # type: ignore[override]
        """The batch's images decoded on ``images.device``, in order (an :class:`Images` list)."""
        if not isinstance(images, EncodedImages):
            raise TypeError(
                f"DecodeJPEG decodes an EncodedImages batch (got {type(images).__name__}); "
                f"read files with ImageBytes and batch them with collate_encoded"
            )
        device = images.device
        buffers = images.buffers()
        if self.decoder == "nvjpeg" and device.type != "cuda":
            raise ValueError(
                f"DecodeJPEG(decoder='nvjpeg') decodes on CUDA, and this batch goes to {device}; "
                f"pass decoder='auto' (nvJPEG on CUDA, Pillow elsewhere) or decoder='pil'"
            )
        if self.decoder == "pil" or (self.decoder == "auto" and device.type != "cuda"):
            return Images(_on(_pil(b, i, images.names[i]), device) for i, b in enumerate(buffers))
        if device.type != "cuda":  # a decoder of the user's, off CUDA: no streams to order
            return Images(self._decode(buffers, images.names, device))
        caller = torch.cuda.current_stream(device)
        stream = self._stream(device, caller)
        with torch.cuda.stream(stream):
            out = self._decode(buffers, images.names, device)
        _follow(caller, stream)
        _keep(out, caller)
        return Images(out)

    def _decode(
        self, buffers: list[torch.Tensor], names: Sequence[str], device: torch.device
    ) -> list[torch.Tensor]:
        """The GPU decoder's images, and PIL's for those it does not take or refuses.

        A decoder that cannot run at all (torchvision missing or broken, built without nvJPEG,
        out of memory, or refusing every image of a batch one by one) raises here, to the
        user: decoding every image on the CPU instead would be the very stall this transform
        removes, unannounced.
        """
        decode = self.decoder if callable(self.decoder) else _nvjpeg_decoder()
        out: list[torch.Tensor | None] = [None] * len(buffers)
        taken = [i for i, b in enumerate(buffers) if _gpu_decodable(b)]
        try:
            decoded = list(decode([buffers[i] for i in taken], device)) if taken else []
        except _REFUSED as e:  # one image it refuses fails the batch: each one alone, then PIL
            _raise_unless_refused(e)
            decoded = []
        if len(decoded) == len(taken):
            for i, image in zip(taken, decoded, strict=True):
                out[i] = image
        else:
            first: BaseException | None = None
            for i in taken:
                try:
                    out[i] = decode([buffers[i]], device)[0]
                except _REFUSED as e:
                    _raise_unless_refused(e)
                    first = first or e
            refused_all = first is not None and len(taken) > 1
            if refused_all and all(out[i] is None for i in taken) and _readable(buffers[taken[0]]):
                raise RuntimeError(
                    f"DecodeJPEG: the GPU's decoder refused each of the batch's {len(taken)} "
                    f"JPEGs, one by one ({first}); it does not work here. Fix its install, or "
                    f"pass DecodeJPEG(decoder='pil') to decode on the CPU"
                ) from first
        return [
            image if image is not None else _on(_pil(buffers[i], i, names[i]), device)
            for i, image in enumerate(out)
        ]

    def _stream(self, device: torch.device, caller: Any) -> Any:
        """The decode stream of ``device`` (see :class:`DecodeStreams`)."""
        return STREAMS.get(device, caller)

    def __repr__(self) -> str:
        return f"DecodeJPEG(decoder={self.decoder!r}, on={self.on!r})"


#: What a GPU decoder raises for an image it will not decode (torchvision: RuntimeError).
_REFUSED = (RuntimeError, ValueError)

#: In a refusal's message: the decoder cannot run at all (torchvision wraps its errors, out of
#: memory included, in a plain RuntimeError).
_CANNOT_RUN = ("out of memory", "not compiled with nvjpeg", "does not exist")


def _raise_unless_refused(error: BaseException) -> None:
    """Re-raise ``error`` where it says the decoder cannot run, rather than refused an image."""
    text = str(error).lower()
    if isinstance(error, torch.OutOfMemoryError) or any(s in text for s in _CANNOT_RUN):
        raise error


class DecodeStreams:
    """One decode stream per device for the process, made on first use.

    One, not one per transform: torch hands out streams from a pool, and the memory freed on a
    stream stays cached in that stream's pool, so a pipeline rebuilt every epoch would leave
    its decoded images' memory in one pool after another. Never the caller's own stream.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, Any] = {}

    def get(self, device: torch.device, caller: Any) -> Any:
        """The decode stream of ``device`` (another one, kept from now on, if it is ``caller``)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            stream = self._streams.get(index)
            while stream is None or stream == caller:  # the pool hands streams round robin
                stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._streams[index] = stream
            return stream


#: The process's decode streams (the simulated CUDA of the tests swaps in its own).
STREAMS = DecodeStreams()


def _follow(caller: Any, stream: Any) -> None:
    """The transforms after the decode run on ``caller``: after the decode's writes."""
    caller.wait_stream(stream)


def _keep(images: list[torch.Tensor], caller: Any) -> None:
    """The images' memory (the decode stream's) is not reused until ``caller`` has read them."""
    for image in images:
        record_stream(image, caller)


#: The frame headers of 8-bit Huffman-coded JPEGs (baseline, extended, progressive): what GPU
#: decoders take. Lossless, hierarchical, arithmetic-coded and 12-bit JPEGs go to PIL.
_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
#: Every other start-of-frame marker: a JPEG of a kind the GPU's decoder does not take.
_OTHER_FRAMES = frozenset({0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF, 0xDE})


def _gpu_decodable(buffer: torch.Tensor) -> bool:
    """An 8-bit Huffman-coded JPEG of 1 or 3 colour components: what GPU decoders take as RGB.

    Read from its frame header, found by walking the segments before it (each read in place,
    however long the EXIF or ICC blocks). CMYK and YCCK JPEGs (4 components), other kinds of
    JPEG and anything else go to PIL: GPU decoders refuse them or, worse, may return other
    colours without an error. Never raises: an unreadable header goes to PIL, which judges.
    """
    size = buffer.numel()
    if size < 4 or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        return False
    start = buffer.data_ptr()
    if ctypes.string_at(start, 3) != _JPEG_START:
        return False
    at = 2
    while at + 10 <= size:
        head = ctypes.string_at(start + at, 10)
        if head[0] != 0xFF:
            return False  # not a marker where one must be
        marker = head[1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _FRAMES:  # FF Cn, length (2), precision (1), height (2), width (2), count
            return head[4] == 8 and head[9] in (1, 3)
        if marker in _OTHER_FRAMES or marker == 0xDA:  # or a scan before any frame header
            return False
        at += 2 + int.from_bytes(head[2:4], "big")
    return False


def _bytes(buffer: torch.Tensor) -> bytes:
    """A contiguous 1-D uint8 host tensor's bytes (one copy, without NumPy)."""
    return ctypes.string_at(buffer.data_ptr(), buffer.numel()) if buffer.numel() else b""


def _nvjpeg_decoder() -> Decoder:
    """torchvision's nvJPEG decoder, imported here: an import that fails is not a refusal."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        raise ImportError(
            "DecodeJPEG on CUDA decodes with torchvision's nvJPEG decoder: install torchvision "
            "for your torch (pip install torchvision), or pass DecodeJPEG(decoder='pil') to "
            "decode on the CPU"
        ) from e

    def decode(buffers: Sequence[torch.Tensor], device: torch.device) -> Sequence[torch.Tensor]:
        return decode_jpeg(list(buffers), mode=ImageReadMode.RGB, device=device)  # type: ignore[no-any-return]

    return decode


def _pil(buffer: torch.Tensor, index: int, name: str) -> torch.Tensor:
    """Image ``index`` decoded by PIL: a (3, H, W) uint8 RGB view of its HWC pixels."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError("DecodeJPEG decodes on the CPU with Pillow: pip install pillow") from e
    try:
        with Image.open(io.BytesIO(_bytes(buffer))) as image:
            rgb = image.convert("RGB")
    except Exception as e:
        what = f"image {index} of the batch" + (f" ({name})" if name else "")
        truncated = "truncated" in str(e).lower()
        fix = (
            "replace it, or let Pillow fill the missing part (PIL.ImageFile."
            "LOAD_TRUNCATED_IMAGES = True, then decoder='pil')"
            if truncated
            else "remove it from the dataset, or replace it with an image file"
        )
        raise ImageDecodeError(
            f"DecodeJPEG could not decode {what}, {buffer.numel()} bytes: {e}. The file is "
            f"not a readable image (corrupt, truncated or not an image): {fix}",
            index=index,
            name=name,
        ) from e
    width, height = rgb.size
    pixels = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return pixels.view(height, width, 3).permute(2, 0, 1)


def _readable(buffer: torch.Tensor) -> bool:
    """Whether PIL decodes ``buffer``: a file the GPU's decoder refused may be a bad file."""
    try:
        _pil(buffer, 0, "")
    except ImageDecodeError:
        return False
    return True


def _on(image: torch.Tensor, device: torch.device) -> torch.Tensor:
    return image if device.type == "cpu" else upload(image, device)
