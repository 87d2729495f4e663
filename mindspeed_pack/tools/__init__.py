"""Command-line tools around a run: look at a pack (``inspect_pack``), compare two runs step by step
(``compare_runs``), summarise a run (``run_summary``); and libraries they and the tests use: a run's metrics
(``run_metrics``), host syncs counted (``host_syncs``), which as commands only say so.

May import ``packing``, ``model`` and ``runtime``; nothing imports it.
"""
