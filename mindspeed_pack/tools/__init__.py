"""Command-line tools around a run: look at a pack (``inspect_pack``), compare two runs step by step
(``compare_runs``), summarise a run (``run_summary``, ``run_metrics``), count host syncs (``host_syncs``).

May import ``packing``, ``model`` and ``runtime``; nothing imports it.
"""
