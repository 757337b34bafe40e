"""The inspect layer: what users read about a compiled step.

``explain()`` (:mod:`.explain`), compile-only estimates (:mod:`.estimate`), dumps and the
HTML report (:mod:`.dumps`, :mod:`.report`, :mod:`.plots`, :mod:`.dot`,
:mod:`.chrome_trace`) and calibration (:mod:`.calibrate`): functions over a compiled step,
importing the layers below and nothing above.
"""
