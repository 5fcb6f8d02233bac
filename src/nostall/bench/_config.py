"""The bench's settings, and the ``nostall bench`` flags generated from them.

Each field carries its help and parser: a new knob is one field (``io_share``: ``--io-share``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._arguments import flag_count, flag_list, flag_number, flag_positive

if TYPE_CHECKING:  # the command line's flags are made without loading torch (--help)
    from .._device import DeviceLike

_share, _naturals = flag_number(float, 0, strict=False), flag_number(int, 0, strict=False)


def _knob(default: Any, help: str, parse: Callable[[str], Any]) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "parse": parse})


@dataclasses.dataclass
class BenchConfig:
    """Every knob of ``nostall bench``; the defaults take about two minutes on two CPU cores."""

    batches: int = _knob(12, "batches per epoch of the synthetic images", flag_count)
    batch_size: int = _knob(32, "samples per batch", flag_count)
    image_size: int = _knob(64, "synthetic images are 3 x SIZE x SIZE uint8", flag_count)
    width: int = _knob(16, "channels of the convnet trained on the synthetic images", flag_count)
    ratios: tuple[float, ...] = _knob(
        (0.25, 0.5, 1.0),
        "load/compute ratios: loading a synthetic batch costs RATIO times the step",
        flag_list(flag_positive),
    )
    io_share: float = _knob(0.0, "share of the synthetic loading spent sleeping (I/O)", _share)
    depth: int = _knob(2, "nostall's prefetch depth", flag_count)
    workers: int | None = _knob(None, "DataLoader workers (default: the cores left)", flag_count)
    compute_threads: int | None = _knob(
        None, "intra-op threads of the step on the CPU (default: half the cores)", flag_count
    )
    repeats: int = _knob(3, "repeats of every timed epoch, contenders alternating", flag_count)
    device: DeviceLike = _knob(None, "where the step runs (default: CUDA if present)", str)  # noqa: RUF009
    contenders: tuple[str, ...] = _knob((), "run only these (comma-separated)", flag_list(str))
    jpeg_images: int = _knob(
        128, "JPEG files of the image workload: an epoch of them (0: none)", _naturals
    )
    jpeg_batch_size: int = _knob(16, "samples per batch of the JPEG files", flag_count)
    jpeg_size: int = _knob(224, "JPEG samples are cropped and resized to SIZE x SIZE", flag_count)
    jpeg_width: int = _knob(4, "channels of the convnet trained on the JPEG samples", flag_count)
    jpeg_cache: str | None = _knob(None, "folder of the JPEG files (~/.cache/nostall)", str)
    regime_batches: int = _knob(
        16, "batches per epoch of the GPU-regime workload (JPEG loading; 0: none)", _naturals
    )
    regime_batch_size: int = _knob(8, "samples per batch of the GPU-regime workload", flag_count)
    device_ms: float = _knob(
        0.0,
        "the GPU-regime step's device time in ms (0: what the cores can feed, 1.25x over)",
        _share,
    )
    launch_ops: int = _knob(
        1000, "small torch ops in the GPU-regime step's launch phase", flag_count
    )
    handoff_batches: int = _knob(2000, "batches of the hand-off micro-benchmark", flag_count)
    convoy_batches: int = _knob(
        1000,
        "batches of each GIL-convoy epoch: GIL-free calls on both threads, as on a GPU (0: none)",
        _naturals,
    )
    min_run_time: float = _knob(0.2, "seconds per micro-benchmark", flag_positive)

    def __post_init__(self) -> None:
        """Each value must be what its flag's parser gives; ``ValueError`` names the field."""
        for f in dataclasses.fields(self):
            value, why = getattr(self, f.name), ""
            if value is None or f.name in ("device", "contenders"):
                continue  # the device is checked where it is resolved, contenders below
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            try:
                ok = bool(text) and f.metadata["parse"](text) == value and value is not True
            except (ValueError, argparse.ArgumentTypeError) as e:
                ok, why = False, f": {e}"
            if not ok:
                raise ValueError(f"{f.name}={value!r} is not valid{why} ({f.metadata['help']})")
        if not 0.0 <= self.io_share <= 1.0:
            raise ValueError(f"io_share must be between 0 and 1 (got {self.io_share!r})")
        from ._contenders import ALL

        unknown = [n for n in self.contenders if n not in {k.name for k in ALL}]
        if unknown:
            raise ValueError(f"unknown contenders {unknown}; choose from {[k.name for k in ALL]}")


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`BenchConfig` field, with its help, parser and default."""
    for f in dataclasses.fields(BenchConfig):
        shown = ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=f.metadata["parse"],
            default=f.default,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} (default: {shown if shown not in ('', None) else '-'})",
        )


def from_flags(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the parsed flags describe (its checks raise ``ValueError``)."""
    return BenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)})
