"""Gradient accumulation with accelerate, the next batches prefetched by nostall.

Run it with `python examples/accelerate_train.py`, or on several GPUs with `accelerate launch
examples/accelerate_train.py`. Stop it and run it again: it resumes from its last checkpoint,
in the middle of an epoch. Prepare the DataLoader first, then wrap the prepared loader.
"""

import os

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import nostall

EPOCHS, CHECKPOINT = 3, "checkpoint"
accelerator = Accelerator(gradient_accumulation_steps=4)
x = torch.randn(2048, 16, generator=torch.Generator().manual_seed(0))
data = TensorDataset(x, x.sum(1, keepdim=True))
loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=2, persistent_workers=True)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
batches = nostall.prefetch(loader)  # after prepare(), on the prepared loader
accelerator.register_for_checkpointing(batches)  # save_state() also saves its position
if os.path.isdir(CHECKPOINT):
    accelerator.load_state(CHECKPOINT)  # model, optimizer, random states, batches' position

for epoch in range(batches.epoch, EPOCHS):
    batches.set_epoch(epoch)
    for step, (inputs, targets) in enumerate(batches):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step % 16 == 15:
            accelerator.save_state(CHECKPOINT)
            accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, checkpoint saved")
