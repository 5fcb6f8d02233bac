"""The clients: what nostall knows of each framework's loader, one module per framework.

Lightning Fabric (``fabric``), Hugging Face accelerate (``accelerate``) and transformers'
Trainer (``transformers``), Lightning's fit loop (``lightning``). Nothing here imports a
framework: a loader is recognised only when the user imported it. A leaf wing: it imports only
the modules shared at the top. Sources, loading and epochs ask it; the engine and staging never
do, the facade only inside its methods::

    a framework's loader -> _sources (what it is) -> _epochs (its iter() count, its shard's
    gradient state mirrored at hand-out) -> the facade (its device, skip_first_batches)
"""
