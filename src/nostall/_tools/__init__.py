"""The tools: what runs the facade to measure, tune and explain it.

``doctor`` measures a loader and the prefetcher over it (``diagnosis`` says what the figures
mean, ``doctor_report`` writes them); ``tune`` searches the settings, each ``trial`` one run,
with ``thread_safety`` checked before threads are tried; ``specs`` parses the CLI's settings;
``cli`` is ``nostall ...``, each subcommand a library call. The tools sit above the facade: they
may import it and every wing below; nothing of the data path imports them. Their part::

    a loader -> tune / doctor: trials through nostall.prefetch -> a setting, a report
"""
