"""Tool-only modules, outside the training path: memory estimates (``tools/estimate_memory.py``,
``bench/``) and reading recipes' metric logs (``tools/ladder.py``)."""
