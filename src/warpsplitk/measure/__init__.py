"""Measurement: the timing method shared by ``bench`` and ``tune``
(``timing``), the benchmark and its plot (``bench``, ``plot``), and the
layer benchmark (``layer_bench``)."""
