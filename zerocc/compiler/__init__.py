"""The compiler layer: from a model and a plan to a scheduled program.

Its packages stack: the plan (:mod:`.plan`, with the DeepSpeed import under it) at the bottom;
then this package's own modules, capture of one training step (:mod:`.capture`), FSDP units
(:mod:`.units`), the state layout the passes produce (:mod:`.state`); the ranks' mesh and tensor
parallelism (:mod:`.parallel`); the passes (:mod:`.passes`, what a pass is in
:mod:`.passes.spec`); and on top the driver (:mod:`.driver`): the pass manager and
:func:`.driver.program.compile_program`, which does all of it. Imports only the IR layer (and
the errors) from outside.
"""
