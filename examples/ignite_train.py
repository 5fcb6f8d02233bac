"""PyTorch-Ignite with nostall, resumable mid-epoch: run it, stop it, resume it.

`python examples/ignite_train.py --checkpoint DIR [--stop-after N]`, then
`python examples/ignite_train.py --checkpoint DIR --resume-from DIR/checkpoint_20.pt`;
on two CPU ranks add `--nproc 2` (gloo).
"""

import argparse
from pathlib import Path

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events, create_supervised_trainer
from ignite.handlers import Checkpoint, DiskSaver
from ignite.utils import manual_seed
from torch.utils.data import DistributedSampler, TensorDataset

import nostall


def training(local_rank: int, args: argparse.Namespace) -> None:
    """Train on this rank (Parallel calls it once per rank, or once in this process)."""
    manual_seed(0)  # the same data and initial weights in every run
    x = torch.randn(256, 16)
    dataset = TensorDataset(x, x.sum(1, keepdim=True))
    shuffle = torch.Generator().manual_seed(0)  # its own generator: nostall replays its draws
    loader = idist.auto_dataloader(dataset, batch_size=16, shuffle=True, generator=shuffle)
    batches = nostall.prefetch(loader, idist.device())  # what the trainer runs on
    model = idist.auto_model(torch.nn.Linear(16, 1))
    optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9))
    loss = torch.nn.functional.mse_loss
    trainer = create_supervised_trainer(model, optimizer, loss, device=idist.device())

    if isinstance(loader.sampler, DistributedSampler):  # on two ranks or more

        @trainer.on(Events.EPOCH_STARTED)
        def set_epoch(engine: Engine) -> None:  # a new order each epoch
            loader.sampler.set_epoch(engine.state.epoch - 1)

    to_save = {"trainer": trainer, "model": model, "optimizer": optimizer, "batches": batches}
    saver = DiskSaver(args.checkpoint, require_empty=False)  # rank 0 writes
    checkpoint = Checkpoint(to_save, saver, n_saved=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=5), checkpoint)
    if args.resume_from:  # the trainer's count, the model, the optimizer, the place in the data
        Checkpoint.load_objects(to_load=to_save, checkpoint=args.resume_from)

    @trainer.on(Events.ITERATION_COMPLETED)
    def stop(engine: Engine) -> None:
        if engine.state.iteration == args.stop_after:
            raise SystemExit  # as if killed here: resume from the last checkpoint

    @trainer.on(Events.EPOCH_COMPLETED)
    def report(engine: Engine) -> None:
        if idist.get_rank() == 0:
            print(f"epoch {engine.state.epoch}: loss {engine.state.output:.4f}")

    trainer.run(batches, max_epochs=3)
    batches.close()
    if idist.get_rank() == 0:
        torch.save(model.state_dict(), args.checkpoint / "final.pt")


if __name__ == "__main__":  # not again in the ranks that Parallel spawns
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint", type=Path, required=True)  # a directory
    parser.add_argument("--resume-from", type=Path)  # one of its checkpoint_N.pt
    parser.add_argument("--stop-after", type=int)  # stop after this many iterations
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()
    backend = "gloo" if args.nproc > 1 else None  # None: this process alone
    with idist.Parallel(backend, nproc_per_node=args.nproc if backend else None) as parallel:
        parallel.run(training, args)
