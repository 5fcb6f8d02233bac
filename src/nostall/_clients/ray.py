"""Ray Train's prepared loader under nostall: ``nostall.prefetch(prepare_data_loader(loader))``.

``ray.train.torch.prepare_data_loader(loader)`` returns a ``DataLoader`` subclass that holds
the loader (rebuilt with a ``DistributedSampler`` when Ray runs several workers), moves each
batch to the worker's device, and is its own iterator: its ``__iter__`` starts the held
loader again and returns itself. nostall treats it as any such iterator (a new epoch at each
``iter()``, resumed by pulling the batches before the state, since a copy of it with another
sampler would still iterate the loader it holds).

Wrapped the other way round, ``prepare_data_loader(nostall.prefetch(loader))`` reads the
loader's attributes through the prefetcher and builds a new ``DataLoader`` from them: the
training loop would iterate that, and nostall would be left out without a word. That is
refused (:func:`refuse_rebuild`). Nothing here imports Ray.
"""

from __future__ import annotations

from types import FrameType

#: Ray Train's modules whose ``prepare_data_loader`` rebuilds a loader from its attributes
#: (Ray Train V2 has its own).
_PREPARING = frozenset({"ray.train.torch.train_loop_utils", "ray.train.v2.torch.train_loop_utils"})


def refuse_rebuild(reader: FrameType) -> None:
    """Raise where Ray's ``prepare_data_loader`` reads a prefetcher's loader to rebuild it.

    ``reader``: the frame reading an attribute of the loader through the prefetcher. Ray
    rebuilds the loader in ``with_sampler``, inside ``prepare_data_loader``, only with several
    workers and a sampler to add; elsewhere (one worker, a loader that has a
    ``DistributedSampler`` already, ``add_dist_sampler=False``) it wraps the prefetcher itself,
    which iterates it, and nothing is refused.

    Raises:
        TypeError: the reader is Ray's ``with_sampler``.
    """
    function, module = reader.f_code.co_name, reader.f_globals.get("__name__")
    if function == "with_sampler" and module in _PREPARING:
        raise TypeError(
            "ray.train.torch.prepare_data_loader() was given a nostall Prefetcher: it builds "
            "a new DataLoader from the loader's attributes (to add a DistributedSampler), and "
            "your loop would iterate that without nostall. Prepare the DataLoader first, then "
            "wrap it: nostall.prefetch(ray.train.torch.prepare_data_loader(loader))"
        )
