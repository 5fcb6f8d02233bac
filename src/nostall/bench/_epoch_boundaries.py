"""``--epochs``: what each way of crossing an epoch boundary pays there, as arrival intervals."""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from .._prefetcher import prefetch
from . import _contenders as c
from ._config import BenchConfig
from ._progress import Progress
from ._sweep import dataset_at

#: The ways of crossing epoch boundaries that ``--epochs`` compares.
EPOCH_CONTENDERS = (
    "DataLoader, workers restarted",
    "DataLoader, persistent workers",
    "seed design (thread loops forever)",
    "nostall",
    "nostall across_epochs",
    "nostall across_epochs, workers restarted",
)


def run_epochs(
    config: BenchConfig,
    compute_s: float,
    hash_rate: float,
    workers: int,
    device: torch.device,
    step: Callable[[Any], float],
    progress: Progress,
) -> dict[str, list[list[float]]]:
    """Batch arrival intervals over ``config.epochs`` epochs at ``config.epochs_ratio``.

    The interval that crosses an epoch boundary (the last batch of one epoch to the first of
    the next) shows what each way pays there: worker start-up, an empty pipeline. At a ratio
    below 1 the loader has time to spare within an epoch, so a seamless boundary can look like
    any other step; at 1 or above every pause of the loader shows in full.
    """
    dataset = dataset_at(config, config.epochs_ratio, compute_s, hash_rate)
    cuda = device.type == "cuda"

    def loader(persistent: bool) -> DataLoader[Any]:
        return DataLoader(
            dataset,
            batch_size=config.batch_size,
            num_workers=workers,
            pin_memory=cuda,
            persistent_workers=persistent,
        )

    def plain(source: DataLoader[Any]) -> Iterable[Any]:
        return c._Reiterable(lambda: c._moved(source, device, cuda))

    makers: dict[str, Callable[[], Iterable[Any]]] = {
        EPOCH_CONTENDERS[0]: lambda: plain(loader(False)),
        EPOCH_CONTENDERS[1]: lambda: plain(loader(True)),
        EPOCH_CONTENDERS[2]: lambda: c.ForeverSeedPrefetcher(loader(False), device),
        EPOCH_CONTENDERS[3]: lambda: prefetch(loader(True), device),
        EPOCH_CONTENDERS[4]: lambda: prefetch(loader(True), device, across_epochs=True),
    }
    with warnings.catch_warnings():  # the warning about restarted workers is the point here
        warnings.simplefilter("ignore", UserWarning)
        makers[EPOCH_CONTENDERS[5]] = lambda: prefetch(loader(False), device, across_epochs=True)
        out: dict[str, list[list[float]]] = {}
        for name, make in makers.items():
            loop = make()
            epochs: list[list[float]] = []
            last = time.perf_counter()
            for _ in range(config.epochs):
                arrivals: list[float] = []
                for batch in loop:
                    now = time.perf_counter()
                    arrivals.append(now - last)
                    last = now
                    step(batch)
                epochs.append(arrivals)
            close = getattr(loop, "close", None)
            if callable(close):
                close()
            del loop
            gc.collect()
            out[name] = epochs
            progress.step(f"epoch boundaries: {name}")
    return out
