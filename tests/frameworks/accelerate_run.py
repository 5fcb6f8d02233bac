"""Train with accelerate's gradient accumulation under torchrun; record what every step saw.

tests/test_accelerate.py runs it with two CPU processes (gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/frameworks/accelerate_run.py OUT plain nostall:2:0 nostall:4:0

Each RUN is ``plain`` (the prepared loader itself) or ``nostall:DEPTH:ACROSS``
(``nostall.prefetch(loader, depth=DEPTH, across_epochs=bool(ACROSS))`` on the prepared loader).
The runs go one after the other in the same processes, each on a fresh model, optimizer and
loader. Every rank writes OUT/RUN/rankR.json (``:`` written as ``-``) with, per step, the sample
indices, ``sync_gradients``, ``end_of_dataloader``, ``remainder`` and what
``gather_for_metrics`` kept of the indices; the final weights; and the error, if one was raised
(building the prefetcher included).
"""

from __future__ import annotations

import argparse
import json
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from torch.utils.data import DataLoader, Dataset

import nostall

SAMPLES = 38  # two ranks of 4: 5 batches each, the last one padded to 4 on rank 1
BATCH = 4
ACCUMULATE = 3
EPOCHS = 2
SEED = 7


class Indexed(Dataset[dict[str, Any]]):
    """Sample i carries its index."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.tensor([i / SAMPLES, 1.0])}


def run(accelerator: Accelerator, spec: str) -> dict[str, Any]:
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        model.bias.fill_(0.125)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(
        Indexed(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(SEED)
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.step = 0  # the accumulation counter, left over from the previous run
    batches: Any = loader
    steps: list[dict[str, Any]] = []
    try:
        if spec != "plain":
            depth, across = spec.split(":")[1:]
            batches = nostall.prefetch(loader, depth=int(depth), across_epochs=bool(int(across)))
        for _ in range(EPOCHS):
            for batch in batches:
                with accelerator.accumulate(model):
                    loss = (model(batch["x"]) - 1).pow(2).mean()
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                    state = accelerator.gradient_state
                    steps.append(
                        {
                            "indices": batch["index"].tolist(),
                            "sync_gradients": accelerator.sync_gradients,
                            "end_of_dataloader": state.end_of_dataloader,
                            "remainder": state.remainder,
                            "gathered": accelerator.gather_for_metrics(batch["index"]).tolist(),
                        }
                    )
        error = None
    except Exception:
        error = traceback.format_exc()
    finally:
        if isinstance(batches, nostall.Prefetcher):
            batches.close()
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    return {"steps": steps, "weights": weights, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    # A collective out of order fails within a minute instead of hanging.
    group = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=60))
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=ACCUMULATE, kwargs_handlers=[group]
    )
    for spec in args.runs:
        result = run(accelerator, spec)
        folder = args.out / spec.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{accelerator.process_index}.json"
        path.write_text(json.dumps(result))
        accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
