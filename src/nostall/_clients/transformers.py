"""Hugging Face ``Trainer``: what nostall must know of it, in one place.

Users put nostall into ``Trainer`` by overriding ``get_train_dataloader`` (see
docs/clients/trainer.md)::

    def get_train_dataloader(self):
        return nostall.prefetch(super().get_train_dataloader(), self.args.device)

``super().get_train_dataloader()`` is accelerate's prepared loader (a ``DataLoaderDispatcher``
over a streaming train set), which nostall iterates through
:class:`~nostall._clients.accelerate.ShardMirror` (``threads=`` loads a shard's samples). Two things
are Trainer's own:

* A mid-epoch resume calls accelerate's ``skip_first_batches(train_dataloader, n)``, which
  Trainer imported by name into its module: that name is among those
  :func:`nostall._clients.accelerate.route_skip_first_batches` routes.
* Trainer gives every training loader ``worker_init_fn=partial(seed_worker, ...)``, whatever the
  user asked, which :func:`is_trainer_seed_worker` recognises.

Nothing here imports transformers: a module that was never imported is not in use.
"""

from __future__ import annotations

import functools
import sys

#: The modules that call accelerate's ``skip_first_batches`` through a name of their own.
SKIP_FIRST_BATCHES_CALLERS = ("transformers.trainer",)


def is_trainer_seed_worker(worker_init_fn: object) -> bool:
    """True for the ``worker_init_fn`` Trainer gives every training loader.

    transformers' ``seed_worker`` seeds the global generators of each worker *process*. Loading
    threads share one process, so it has no per-thread counterpart; and ``threads=`` needs
    ``dataloader_num_workers=0``, where Trainer's own loader never calls it either. A warning
    that it is not called would name a fix the Trainer user cannot apply.
    """
    module = sys.modules.get("transformers.trainer_utils")
    seed_worker = getattr(module, "seed_worker", None)
    if seed_worker is None:
        return False
    if isinstance(worker_init_fn, functools.partial):
        worker_init_fn = worker_init_fn.func
    return worker_init_fn is seed_worker
