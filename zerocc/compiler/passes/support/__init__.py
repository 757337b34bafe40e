"""The passes' helpers: analyses and emitters that passes call, registering nothing.

Each is run by the passes named beside it, never by the pass manager:

- ``param_uses``: where the captured graph uses each unit's parameters (shard, recompute).
- ``gradients``: where each unit's gradient goes: accumulators, packs, reductions (shard;
  ``solo`` also read by optimizer and offload).
- ``bucketing``: small collectives merged into buckets (overlap).
- ``deferred_updates``: each step's host updates carried into the next (offload's
  ``defer_updates``; the runtime's ``carried`` reads its layout).
- ``gradient_checks``: the non-finite check split per gradient (offload).
- ``host_slots``: the host buffers offload's copies go through in turn (offload).
- ``owners``: which parameters take Muon, and the rank that owns each matrix's update
  (optimizer).
- ``owned_update``: Muon's update, each matrix orthogonalized once by its owner (optimizer).

They sit below the passes in the compiler's layering (``tests/test_layers.py``): they import
the IR, the plan, the units and the mesh, and nothing of ``zerocc.compiler.passes``.
"""
