"""Loading: a loader's samples loaded into batches by nostall's own threads (``threads=``).

``pool`` runs the loading threads (tasks in order, started on demand, idle ones end);
``threads`` fetches a map-style loader's samples with them, ``threaded_stream`` an
IterableDataset's (N threads as N workers, in turn); ``threadable`` says once whether
``threads=`` can load a source, with the fix; ``pacing`` paces the producer's pulls so that the
loading threads leave the GIL to the consumer's launches; ``collate`` is ``collate_uint8``. It
imports the sources and clients wings and the shared modules. Its part of the data path::

    sampler indices -> pool (N threads: dataset[i]) -> collate, in order -> the epoch's batches
    pacing: told of each hand-off by the engine's channel, as its observer
"""
