"""Measurement: the timing method shared by ``bench`` and ``tune``
(``timing``), the benchmark (``bench``), the layer benchmark
(``layer_bench``) and its plot (``plot``)."""
