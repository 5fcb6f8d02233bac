"""The engine: the hand-off between the producer thread and the consumer.

``channel`` is the bounded hand-off (at most ``depth`` ahead, in order); ``producer`` is the
puller that fills it (``next(source)``, staging, the epoch's end and the next one's start) and
``producer_thread`` its thread; ``latest_producer`` keeps one producer at a time; ``iteration``
empties the channel in the consumer's ``next()``; ``lineage`` is what one pass hands the next;
``settings`` the arguments after the source, checked once; ``autodepth`` how deep
``depth="auto"`` may grow; ``profile`` the waits recorded with ``profile=True``. It imports the
epochs, loading, sources and staging wings, the ``cuda`` toolkit and the shared modules, never
a client; ``channel`` imports only the shared modules (a threaded epoch's pacer reaches it as a
``HandOffObserver``). Its part of the data path::

    producer thread: producer (next(source) -> staging) -> channel.put
    consumer: iteration.__next__ -> channel.get -> the consumer's stream waits -> batch
"""
