"""From a tactic to one launch: compiling (``compile``, ``elf``), the disk
cache and compile workers (``disk_cache``, ``precompile``), the launcher
(``launch``) and the prepared weight (``prepared``)."""
