"""Which tactic runs a shape: the tactic space and its twin rules
(``space``), the fitted cost model (``cost_model``), the default choice
(``choose``) and its options read off measured pairs (``measured_options``),
the tuner (``tune``), plan files and ``prepare`` (``plans``), and per-GPU
plans in the cache folder (``plan_cache``)."""
