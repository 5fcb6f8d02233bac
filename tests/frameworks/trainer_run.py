"""Train a tiny model with Hugging Face ``Trainer``, with or without nostall; record what it saw.

tests/test_transformers.py imports :func:`train` (runs in its own process) and runs this file
for resumes in a fresh process::

    python tests/frameworks/trainer_run.py SPEC.json [SPEC.json ...]

Each SPEC is a :class:`Spec` as JSON; each run writes its :class:`Seen` to ``SPEC.out/seen.json``
and its final weights to ``SPEC.out/weights.pt``.

The model's forward records the indices of each micro-batch (the dataset's items carry their
index) and which nostall threads were alive then; a callback records where each optimizer step
ended. So a run shows the samples of every step and the gradient-accumulation boundaries.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import nostall

ROOT = Path(__file__).resolve().parent.parent.parent
PAGE = ROOT / "docs" / "clients" / "trainer.md"
SAMPLES = 44  # 11 batches of 4 per epoch: steps of 4, 4 and 3 batches
BATCH = 4
ACCUMULATE = 4
EPOCHS = 2
STEPS_PER_EPOCH = 3
# A checkpoint after every step: checkpoint-3 is at an epoch's end, checkpoint-4 mid-epoch.
SAVE_STEPS = 1
LENGTH = 6
VOCAB = 16
SEED = 11


class Indexed(Dataset[dict[str, Any]]):
    """Sample i carries its index; its tokens and label are a fixed function of i.

    ``loaded_by``: the names (less their number) of the threads of this process that loaded it.
    """

    def __init__(self) -> None:
        self.loaded_by: set[str] = set()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        self.loaded_by.add(threading.current_thread().name.rsplit("-", 1)[0])
        ids = [(i * 7 + 3 * k) % VOCAB for k in range(LENGTH)]
        return {"input_ids": torch.tensor(ids), "labels": i % 2, "index": i}


class Stream(IterableDataset[dict[str, Any]]):
    """The samples of :class:`Indexed` as a stream without a length (as HF streaming gives).

    Each epoch yields them in an order drawn from its epoch (``set_epoch``, which accelerate's
    loader passes on), so that a resume that gave the wrong epoch would show.
    """

    def __init__(self) -> None:
        self.samples = Indexed()
        self.loaded_by = self.samples.loaded_by
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(self.epoch))
        for i in order.tolist():
            yield self.samples[i]


class Recorded(BertForSequenceClassification):  # type: ignore[no-untyped-call]
    """A 1-layer BERT whose forward records each micro-batch's indices (as users log batches)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self.seen: list[list[int]] = []
        self.threads: list[list[str]] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> Any:
        self.seen.append(index.tolist())
        alive = {t.name.rsplit("-", 1)[0] for t in threading.enumerate()}
        self.threads.append(sorted(n for n in alive if n.startswith("nostall")))
        return super().forward(input_ids=input_ids, labels=labels)


class StepEnds(TrainerCallback):
    """Records how many micro-batches the model had seen when each optimizer step ended."""

    def __init__(self, model: Recorded) -> None:
        self.model = model
        self.ends: list[int] = []
        self.loader: str | None = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(len(self.model.seen))
        loader = kwargs.get("train_dataloader")
        self.loader = type(getattr(loader, "source", loader)).__name__


@dataclasses.dataclass
class Spec:
    """One training run.

    ``trainer``: ``"plain"`` (transformers' Trainer), a class defined by the first python block
    of docs/clients/trainer.md, or ``"prefetch"``: a Trainer whose ``get_train_dataloader`` is
    ``nostall.prefetch(super().get_train_dataloader(), **prefetch)``. ``stream``: train on
    :class:`Stream` for as many steps (accelerate prepares it as a ``DataLoaderDispatcher``).
    """

    out: str
    trainer: str = "plain"
    prefetch: dict[str, Any] = dataclasses.field(default_factory=dict)
    workers: int = 0
    resume: str | None = None
    stream: bool = False


@dataclasses.dataclass
class Seen:
    """What a run trained on: micro-batch indices per optimizer step, and who loaded them.

    ``threads``: the nostall threads alive at each forward; ``loaded_by``: the threads of this
    process that loaded samples (none with worker processes); ``loader``: the type of the
    prepared loader trained on (behind the prefetcher, if any).
    """

    steps: list[list[list[int]]]
    threads: list[list[str]]
    loaded_by: list[str]
    error: str | None = None
    loader: str | None = None


def page_namespace() -> dict[str, Any]:
    """The names defined by the first python block of docs/clients/trainer.md, run as is."""
    text = PAGE.read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "trainer_page"}
    exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def trainer_class(spec: Spec) -> type[Trainer]:
    if spec.trainer == "plain":
        return Trainer
    if spec.trainer != "prefetch":
        found: type[Trainer] = page_namespace()[spec.trainer]
        return found
    options = dict(spec.prefetch)

    class Prefetching(Trainer):
        def get_train_dataloader(self) -> Any:
            return nostall.prefetch(super().get_train_dataloader(), **options)

    return Prefetching


def train(spec: Spec) -> Seen:
    """Train (or resume) as ``spec`` says; the weights go to ``spec.out/weights.pt``."""
    out = Path(spec.out)
    # num_labels reaches the config through its **kwargs, which the typed __init__ leaves out.
    config = BertConfig(  # type: ignore[call-arg]
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=LENGTH,
        num_labels=2,
    )
    torch.manual_seed(SEED)  # the weights, drawn before Trainer seeds anything
    model = Recorded(config)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        num_train_epochs=EPOCHS,
        # A stream has no length: Trainer counts its steps (which override the epochs).
        max_steps=EPOCHS * STEPS_PER_EPOCH if spec.stream else -1,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        logging_strategy="no",
        dataloader_num_workers=spec.workers,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=SEED,
    )
    ends = StepEnds(model)
    dataset = Stream() if spec.stream else Indexed()
    trainer = trainer_class(spec)(model=model, args=args, train_dataset=dataset, callbacks=[ends])
    error = None
    try:
        trainer.train(resume_from_checkpoint=spec.resume)
    except Exception as e:  # recorded: the test says which run failed, and how
        error = f"{type(e).__name__}: {e}"
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "weights.pt")
    starts = [0, *ends.ends]
    steps = [model.seen[a:b] for a, b in zip(starts, ends.ends, strict=False)]
    return Seen(steps, model.threads, sorted(dataset.loaded_by), error, ends.loader)


def main(paths: list[str]) -> None:
    for path in paths:
        spec = Spec(**json.loads(Path(path).read_text()))
        seen = train(spec)
        (Path(spec.out) / "seen.json").write_text(json.dumps(dataclasses.asdict(seen)))


if __name__ == "__main__":
    main(sys.argv[1:])
