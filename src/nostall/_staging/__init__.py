"""Staging: a batch from the host to its device, in the thread that pulled it.

``choose`` picks one staging per device; ``base`` stages where no streams are needed (CPU, XPU;
on MPS in the consumer's thread); ``cuda`` pins, copies on a side stream lent by
``copy_streams`` and records the ready event. It knows no source, epoch or framework: it
imports only the ``cuda`` toolkit and the shared modules. Its part of the data path::

    pulled batch -> base / cuda: pin -> copy (side stream) -> transform -> ready event
                 -> the engine's channel; at hand-out the consumer's stream waits on the event
"""
