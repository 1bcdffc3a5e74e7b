"""Which tactic runs a shape: the tactic space (``space``), the fitted cost
model and its options (``cost_model``, ``neighbours``), the tuner
(``tune``), plan files and ``prepare`` (``plans``), and per-GPU plans in
the cache folder (``plan_cache``)."""
