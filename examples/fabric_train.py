"""Lightning Fabric with nostall, resumable mid-epoch: run it, stop it, run it again.

`python examples/fabric_train.py --checkpoint DIR`, or on two CPU ranks
`fabric run --accelerator cpu --devices 2 --strategy ddp examples/fabric_train.py --checkpoint DIR`.
"""

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, TensorDataset

import nostall

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", type=Path, required=True)  # a directory
parser.add_argument("--stop-after", type=int)  # stop after this many steps, as if killed
args = parser.parse_args()
fabric = Fabric()  # settings from `fabric run`, else one device
fabric.launch()
fabric.seed_everything(0)  # the same data and initial weights in every run
x = torch.randn(256, 16)
shuffle = torch.Generator().manual_seed(0)  # its own generator: nostall replays its draws
dataset = TensorDataset(x, x.sum(1, keepdim=True))
loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=shuffle)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
model, optimizer = fabric.setup(model, optimizer)
batches = nostall.prefetch(fabric.setup_dataloaders(loader))  # Fabric's loader, prefetched
state = {"model": model, "optimizer": optimizer, "data": batches, "step": 0}
checkpoint = args.checkpoint / "last.ckpt"
if checkpoint.exists():
    fabric.load(checkpoint, state)  # the model, the optimizer, the place in the data
step = state["step"]
for epoch in range(batches.epoch, 3):
    for inputs, targets in batches:
        accumulating = (step + 1) % 4 != 0  # one optimizer step every 4 batches
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            fabric.backward(loss)
        step += 1
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = step
            fabric.save(checkpoint, state)  # at an optimizer step: no gradients half-summed
        if step == args.stop_after:
            raise SystemExit  # as if killed here: the next run resumes from the checkpoint
    fabric.print(f"epoch {epoch}: loss {loss.item():.4f}")
fabric.save(args.checkpoint / "final.ckpt", {"model": model})
