"""Epochs: opening the source's epochs, and resuming inside one.

``epochs`` opens each epoch (``set_epoch``, the order drawn, a replayed order, a threaded
epoch's loading threads); ``drawn_orders`` records what each epoch's order was drawn from, to
draw it again; ``skip`` skips the batches of an epoch already handed out; ``resume`` is where
the consumer is (one ``Position``) and the ``state_dict`` made from it. It imports the loading,
sources and clients wings (a Fabric loader's ``iter()`` count and accelerate's shard mirror are
part of an epoch's order) and the shared modules. Its part of the data path::

    source -> epochs.open(epoch): set_epoch, order drawn (or replayed), skip on resume
           -> an iterator of batches the engine's producer pulls
"""
