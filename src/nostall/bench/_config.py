"""The benchmark's settings: every knob of ``nostall bench``, checked before anything runs."""

from __future__ import annotations

from dataclasses import dataclass

from .._device import DeviceLike
from . import _contenders as c


@dataclass
class BenchConfig:
    """Every knob of ``nostall bench``; the defaults take about two minutes on two CPU cores."""

    batches: int = 32
    batch_size: int = 32
    image_size: int = 64
    width: int = 16
    ratios: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)
    depths: tuple[int, ...] = (2,)
    io_share: float = 0.0
    workers: int | None = None
    compute_threads: int | None = None
    repeats: int = 3
    device: DeviceLike = None
    contenders: tuple[str, ...] = ()
    handoff_batches: int = 2000
    h2d_mb: tuple[float, ...] = (8.0, 32.0, 128.0)
    epochs: int = 5
    epochs_ratio: float = 0.5
    gpu_transforms: bool = False
    transform_image_size: int = 128
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, int) or self.epochs < 0:
            raise ValueError(
                f"epochs must be 0 (no boundary test) or an int >= 2 (got {self.epochs!r})"
            )
        if not self.epochs_ratio > 0:
            raise ValueError(f"epochs_ratio must be > 0 (got {self.epochs_ratio!r})")
        if self.epochs == 1:
            raise ValueError("epochs must be 0 (no boundary test) or an int >= 2 (got 1)")
        for name in (
            "batches",
            "batch_size",
            "image_size",
            "width",
            "repeats",
            "handoff_batches",
            "transform_image_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (got {value!r})")
        if not self.ratios or any(not r > 0 for r in self.ratios):
            raise ValueError(f"ratios must be numbers > 0 (got {self.ratios!r})")
        if not self.depths or any(isinstance(d, bool) or d < 1 for d in self.depths):
            raise ValueError(f"depths must be ints >= 1 (got {self.depths!r})")
        if not 0.0 <= self.io_share <= 1.0:
            raise ValueError(f"io_share must be between 0 and 1 (got {self.io_share!r})")
        known = {k.name for k in c.ALL}
        unknown = [name for name in self.contenders if name not in known]
        if unknown:
            raise ValueError(f"unknown contenders {unknown}; choose from {sorted(known)}")
