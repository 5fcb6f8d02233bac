"""Lightning on nostall.prefetch(loader), resumable mid-epoch: run it, or pass a checkpoint."""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import nostall


class Classifier(L.LightningModule):
    """A linear classifier: your LightningModule here."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def training_step(self, batch, batch_idx):
        """Cross-entropy of one batch."""
        return torch.nn.functional.cross_entropy(self.layer(batch[0]), batch[1])

    def configure_optimizers(self):
        """Plain SGD."""
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PrefetcherState(L.Callback):
    """Saves the prefetcher's place in the data with each checkpoint, and resumes from it."""

    def __init__(self, prefetcher: nostall.Prefetcher) -> None:
        self.prefetcher = prefetcher

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        """The epoch, and how many of its batches were trained on."""
        checkpoint["nostall"] = self.prefetcher.state_dict()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        """The next batch is the one after the last trained on before the checkpoint."""
        self.prefetcher.load_state_dict(checkpoint["nostall"])


if __name__ == "__main__":
    L.seed_everything(0)  # the same data in a resumed run
    dataset = TensorDataset(torch.randn(2048, 32), torch.randint(0, 2, (2048,)))
    loader = DataLoader(
        dataset, batch_size=64, shuffle=True, num_workers=2, persistent_workers=True
    )
    batches = nostall.prefetch(loader, shard=True, across_epochs=True)  # DDP: each rank its part
    trainer = L.Trainer(max_epochs=2, callbacks=[PrefetcherState(batches)])
    trainer.fit(Classifier(), batches, ckpt_path=sys.argv[1] if len(sys.argv) > 1 else None)
    batches.close()
