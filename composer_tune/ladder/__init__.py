"""The ladder's library: its arms (``arms``), running them as ``tune run`` processes and
recording their results (``runs``), and the tables and plots of those results (``report``).
``tools/ladder.py`` is the command over it."""
