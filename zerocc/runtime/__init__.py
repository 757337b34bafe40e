"""The runtime layer: running a compiled program on ranks.

Process groups and their heartbeat (:mod:`.comm`, :mod:`.watchdog`, :mod:`.agreement`), the
copy engine and NVMe store (:mod:`.transfers`, :mod:`.nvme`), devices and launching
(:mod:`.devices`, :mod:`.rank`, :mod:`.launch`), failures (:mod:`.failures`), the memory
check (:mod:`.memory_check`) and the step runner (:mod:`.step`). Backends
(:mod:`zerocc.backends`) belong to this layer. Imports the cost, compiler and IR layers.
"""
