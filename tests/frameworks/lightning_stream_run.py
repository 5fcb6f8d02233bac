"""One Lightning fit over a stream loaded by ``threads=2``, in a process of its own.

``python lightning_stream_run.py OUT.json [--save DIR] [--resume CKPT] [--across]``: seeds,
trains :class:`Recorder` on ``nostall.prefetch(stream_loader(0), "cpu", threads=2)`` for
EPOCHS epochs, saving a checkpoint every :data:`MID_STEP` steps into ``--save``, or resuming
from ``--resume``; writes the sample indices trained on per epoch and the final weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
from frameworks.lightning_run import (
    BATCH,
    SAMPLES,
    SEED,
    Recorder,
    make_trainer,
    stream_loader,
)
from lightning.pytorch.callbacks import ModelCheckpoint

import nostall

#: A checkpoint after the 3rd step of epoch 1.
MID_STEP = SAMPLES // BATCH + 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--across", action="store_true")
    args = parser.parse_args()
    L.seed_everything(SEED, verbose=False)
    loader = nostall.prefetch(stream_loader(0), "cpu", across_epochs=args.across, threads=2)
    model = Recorder()
    callbacks = []
    if args.save is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=args.save,
                filename="{epoch}-{step}",
                save_top_k=-1,
                every_n_train_steps=MID_STEP,
            )
        )
    trainer = make_trainer(callbacks=callbacks, enable_checkpointing=args.save is not None)
    trainer.fit(model, loader, ckpt_path=args.resume)
    loader.close()
    args.out.write_text(json.dumps({"seen": model.seen, "weights": model.weights()}))


if __name__ == "__main__":
    main()
