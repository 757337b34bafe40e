"""The compiler layer: from a model and a plan to a scheduled program.

The plan (:mod:`.plan`), capture of one training step (:mod:`.capture`), FSDP units
(:mod:`.units`), the state layout the passes produce (:mod:`.state`), the pass manager
(:mod:`.pass_manager`) running the passes of :mod:`zerocc.compiler.passes`, and
:func:`.program.compile_program`, which does all of it. Imports only the IR layer.
"""
