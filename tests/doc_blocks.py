"""Run one python block of the README or of a docs/ page, as a reader runs it after the ten lines.

tests/test_examples.py lists the blocks with :func:`pages` and :func:`python_blocks`, and runs
each with :func:`main`: on the CPU in the test's process, as written on a GPU in a process of its
own::

    python tests/doc_blocks.py PAGE INDEX [--as-written]

A block uses what the README's ten lines import and assume (``torch``, ``nostall``,
``DataLoader``; ``dataset``, ``model``, ``optimizer``, ``epochs``) and what a page takes from
the loop around it (``loader``, ``checkpoint``, ``folder``). This script makes small ones: 64
uint8 images of 3 x 32 x 32 with their labels, a linear model over the images' channel means,
2 epochs, a ``DataLoader`` of 4 shuffled batches, a checkpoint whose ``"data"`` is the state of
a prefetcher over that loader after one batch, and (for a block that names it) a ``folder`` of
16 small JPEG files in two class folders, as torchvision's ``ImageFolder`` reads them.

The blocks are written for a GPU (``device="cuda"``). Without ``--as-written`` every ``"cuda"``
string in the block becomes ``"cpu"``, so that ``make test`` runs them on any machine; the
``cuda``-marked tests pass ``--as-written`` on a machine with CUDA. After the block, a
prefetcher it left in ``batches`` must still yield a batch (a block may only build one). The
last line printed is ``ran``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import nostall

ROOT = Path(__file__).resolve().parent.parent


def pages() -> list[Path]:
    """The README and the docs/ pages whose blocks run here (docs/clients/ has its own tests)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(page: Path) -> list[str]:
    """The page's python blocks, in order."""
    return re.findall(r"^```python\n(.*?)\n```$", page.read_text(), flags=re.DOTALL | re.MULTILINE)


class Images(Dataset[tuple[torch.Tensor, int]]):
    """64 uint8 images (3, 32, 32), the same on every run, each with a label of 10 classes."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        generator = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=generator)
        return image, index % 10


class Model(torch.nn.Module):
    """Logits from the channel means: takes any (N, C, H, W) batch, uint8 or float."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.linear(images.float().mean((2, 3)))
        return logits


def yours(device: str) -> dict[str, Any]:
    """The names the blocks take from the reader's program."""
    torch.manual_seed(0)
    dataset = Images()
    model = Model().to(device)
    loader = DataLoader(dataset, batch_size=16, shuffle=True)
    with nostall.prefetch(loader, device, across_epochs=True) as ahead:
        next(iter(ahead))
        state = ahead.state_dict()
    return {
        "torch": torch,
        "nostall": nostall,
        "DataLoader": DataLoader,
        "dataset": dataset,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "epochs": 2,
        "loader": loader,
        "checkpoint": {"data": state},
    }


def image_folder() -> str:
    """16 JPEG files of a few sizes in two class folders, in a temporary directory."""
    import tempfile

    from PIL import Image

    root = Path(tempfile.mkdtemp(prefix="nostall-doc-images-"))
    for i in range(16):
        folder = root / ("cat", "dog")[i % 2]
        folder.mkdir(exist_ok=True)
        Image.effect_noise((40 + i, 30 + i % 3), 40).convert("RGB").save(folder / f"{i}.jpg")
    return str(root)


def main(argv: list[str]) -> None:
    page, index = ROOT / argv[0], int(argv[1])
    as_written = "--as-written" in argv[2:]
    block = python_blocks(page)[index]
    if not as_written:
        block = block.replace('"cuda"', '"cpu"')
    names = yours("cuda" if as_written else "cpu")
    if "folder" in block:
        names["folder"] = image_folder()
    exec(compile(block, f"{page.name}, python block {index}", "exec"), names)
    batches = names.get("batches")
    if isinstance(batches, nostall.Prefetcher):
        with batches:
            next(iter(batches))
    print("ran")


if __name__ == "__main__":
    main(sys.argv[1:])
