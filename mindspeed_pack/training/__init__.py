"""The training loop and what varies around it: the :class:`~.trainer.Trainer` (setup / train /
evaluate / cleanup), its stages (``stages/``: SFT, DPO, SimPO, ORPO, KTO, reference and rollout scoring, GRPO,
reward models), the micro-batch seam (``batches``), model and optimizer setup (``model_setup``), the learning-rate
schedule, metrics, precision and throughput, the one-command raw-data step (``raw_data``), the
``--dry-run`` plan and epochs (``run_plan``), RL sessions and the scripts' shared ``cli``.

The top floor below the entry points: may import every other package; none imports it.
"""
