"""How the ranks divide the work beyond ZeRO's shards: the ranks' mesh (:mod:`.mesh`) and
tensor parallelism (:mod:`.tensor_parallel`: the layers a plan splits, captured in their split
form by :mod:`.capture_mode`, with the collectives of :mod:`.collectives` and the sequence
parallelism of :mod:`.sequence`)."""
