"""Sources: what the source is, decided once, and what it draws.

``sources`` says the kind every other module asks (a DataLoader, a framework's loader, an
iterable); ``samplers`` what its sampler says and does; ``generators`` and ``global_draws``
the global random generators a source draws from; ``sharding`` each rank's part
(``shard=True``); ``webdataset`` webdataset's shuffles; ``checks`` what cannot run ahead
(refused) or cannot be exact (warned). It imports the clients (to recognise a framework's
loader) and the shared modules, nothing downstream. Its part of the data path::

    source -> sources (its kind) -> sharding (its rank's part) -> the epochs wing opens it
"""
