"""Which tactic runs a shape: the tactic space (``space``), the fitted cost
model and its options (``cost_model``, ``neighbours``), plan data and files
(``decode_plan``), the tuner (``tune``; its log ``tune_log``, its choosing
rules ``selection``), per-GPU plans in the cache folder (``plan_cache``),
and preparing weights with a plan (``plans``)."""
