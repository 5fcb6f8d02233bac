"""Multi-process training with DistributedDataParallel, a DistributedSampler and nostall.prefetch.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --epochs 2

NCCL on GPUs when there is one per rank (cuda:LOCAL_RANK), else gloo on the CPU. Each rank
prefetches its own shard across epochs; at the end rank 0 prints every rank's stall report and
names the slowest.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nostall


def main() -> None:
    """Train a small classifier on synthetic data, every rank on its shard."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()

    # NCCL with one GPU per rank where there are enough; otherwise gloo on the CPU.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    generator = torch.Generator().manual_seed(0)  # the same data on every rank
    features = torch.randn(args.samples, 32, generator=generator)
    labels = (features[:, :4].sum(1) > 0).long()
    dataset = TensorDataset(features, labels)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)
    batches = nostall.prefetch(loader, device, across_epochs=True, profile=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(
            device
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(args.epochs):
        batches.set_epoch(epoch)  # a no-op: across_epochs already started it
        total = 0.0
        for x, y in batches:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss)
        print(f"rank {rank} epoch {epoch}: mean loss {total / len(batches):.4f}", flush=True)
    report = batches.report(all_ranks=True)
    if rank == 0:
        print(report)
        print("slowest rank:", report.slowest_rank)
    batches.close()
    # Every rank reaches the end before any tears its process group down: a rank that exits
    # while another still talks to it can abort the other's gloo threads.
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
