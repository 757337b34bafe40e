"""The cost layer: what a program will cost, predicted without running it.

Work and rates per node (:mod:`.model`), memory liveness and peak (:mod:`.memory`), the
two-stream simulator (:mod:`.simulate`) and the timeline records they fill
(:mod:`.timeline`). Imports the compiler and IR layers only.
"""
