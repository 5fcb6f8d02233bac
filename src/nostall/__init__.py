"""nostall keeps the GPU fed: it removes input-pipeline stalls from PyTorch training.

``for batch in nostall.prefetch(loader): ...`` yields the loader's batches, in order, already on
the device: fetched, pinned and copied in the background while the model computes.
"""

from . import transforms
from ._collate import collate_uint8
from ._exceptions import (
    DeviceUnavailableError,
    NostallError,
    PrefetcherClosedError,
    PrefetchTimeoutError,
    ProducerDiedError,
)
from ._prefetcher import Prefetcher, PrefetchIterator, prefetch
from ._profile import StallReport, profile
from ._transfer import pin_memory, to_device
from ._tune import TuneResult, tune

__version__ = "0.1.0"

__all__ = [
    "DeviceUnavailableError",
    "NostallError",
    "PrefetchIterator",
    "PrefetchTimeoutError",
    "Prefetcher",
    "PrefetcherClosedError",
    "ProducerDiedError",
    "StallReport",
    "TuneResult",
    "__version__",
    "collate_uint8",
    "pin_memory",
    "prefetch",
    "profile",
    "to_device",
    "transforms",
    "tune",
]
