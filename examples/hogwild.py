"""Hogwild training: several processes update one model in shared memory, without locks.

    python examples/hogwild.py --processes 2

The model's parameters live in shared memory (``share_memory()``); each
``torch.multiprocessing`` process trains on its own shard and writes its updates straight
into them. It prints the shared model's accuracy before and after.
"""

from __future__ import annotations

import argparse

import torch
import torch.multiprocessing as mp


def make_data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A linearly separable task, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 16, generator=generator)
    return x, (x[:, :3].sum(1) > 0).long()


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of correct predictions."""
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(rank: int, model: torch.nn.Module, processes: int, samples: int, steps: int) -> None:
    """One worker: SGD on its shard, updating the shared parameters in place."""
    torch.set_num_threads(1)  # the processes share the cores
    x, y = make_data(samples)
    x, y = x[rank::processes], y[rank::processes]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        pick = torch.randint(0, len(x), (32,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x[pick]), y[pick])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main() -> None:
    """Train the shared model from several processes and report its accuracy."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 2)
    model.share_memory()  # parameters in shared memory: every process updates the same ones
    x, y = make_data(args.samples)
    print(f"accuracy before: {accuracy(model, x, y):.3f}")
    workers = [
        mp.Process(target=train, args=(rank, model, args.processes, args.samples, args.steps))
        for rank in range(args.processes)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(
        f"accuracy after {args.processes} processes x {args.steps} steps: "
        f"{accuracy(model, x, y):.3f}"
    )


if __name__ == "__main__":
    main()
