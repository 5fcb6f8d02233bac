"""Resume DDP mid-epoch, every rank from its own checkpoint (gloo on the CPU)."""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nostall

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", type=Path, required=True)  # a directory the ranks share
parser.add_argument("--stop-after", type=int)  # stop after this many steps, as if killed
parser.add_argument("--workers", type=int, default=0)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
mine, seen_file = args.checkpoint / f"rank{rank}.pt", args.checkpoint / f"seen-rank{rank}.json"
torch.manual_seed(0)  # the same data and initial weights on every rank, in every run
dataset = TensorDataset(torch.arange(80), torch.randn(80, 8), torch.randn(80, 1))  # index first
sampler = DistributedSampler(dataset, shuffle=True, seed=0)
workers = {"num_workers": args.workers, "persistent_workers": args.workers > 0}
loader = DataLoader(dataset, 8, sampler=sampler, **workers)
batches = nostall.prefetch(loader, "cpu", across_epochs=True)  # where the model is, with gloo
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
seen = json.loads(seen_file.read_text()) if mine.exists() else {}  # epoch -> sample indices
if mine.exists():  # resume: this rank's model, optimizer and place in its own shard
    checkpoint = torch.load(mine)
    model.module.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    batches.load_state_dict(checkpoint["data"])
step = 0
for epoch in range(batches.epoch, 3):
    batches.set_epoch(epoch)
    for index, inputs, targets in batches:
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.setdefault(str(epoch), []).extend(index.tolist())
        checkpoint = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**checkpoint, "data": batches.state_dict()}, mine)  # this rank's own
        seen_file.write_text(json.dumps(seen))
        step += 1
        if step == args.stop_after:
            raise SystemExit  # as if killed here: the next run resumes from the checkpoints
if rank == 0:
    torch.save(model.module.state_dict(), args.checkpoint / "final.pt")
dist.destroy_process_group()
