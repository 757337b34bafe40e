"""The IR layer: what a program is made of.

A program is an ordinary ``torch.fx.GraphModule``. This layer holds the conventions every
other layer reads: the typed record on each node (:mod:`.nodes`), zerocc's op schemas with
their fake implementations (:mod:`.ops`), which storages a node reads and writes
(:mod:`.access`), the printed form of a program (:mod:`.printing`) and its invariants
(:mod:`.verify`). It imports nothing from the layers above it.
"""
