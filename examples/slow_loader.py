"""A training loop whose loader is slow, to try ``nostall doctor`` on.

nostall doctor examples.slow_loader:make_loader --step examples.slow_loader:train_step
"""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset


class SlowImages(Dataset[tuple[torch.Tensor, int]]):
    """Each sample waits 2 ms, as a read from a network filesystem would."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.002)
        return torch.full((3, 32, 32), i % 255, dtype=torch.uint8), i % 10


def make_loader(
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    persistent_workers: bool = False,
) -> DataLoader[tuple[torch.Tensor, int]]:
    """The loader as a training script builds it; the doctor passes its overrides here."""
    return DataLoader(
        SlowImages(),
        batch_size=32,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
    )


model = torch.nn.Sequential(
    torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One SGD step on a batch already on the device."""
    images, labels = batch
    loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.item())
