"""Which tactic runs a shape: the tactic space and its twin rules
(``space``), the fitted cost model (``cost_model``), the default choice
(``choose``) and its options read off measured pairs (``measured_options``),
plan data and files (``decode_plan``), the tuner (``tune``; its log
``tune_log``, its choosing rules ``selection``), per-GPU plans in the cache
folder (``plan_cache``), and preparing weights with a plan (``plans``)."""
