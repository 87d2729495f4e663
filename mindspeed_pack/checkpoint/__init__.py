"""A training run's checkpoints: save, load and resume in Megatron's layout (``save_load``, ``resume``,
``rank_files``), a Hugging Face directory loaded straight into a run and the ``--save-hf`` export
(``hf_checkpoint``), LoRA adapter checkpoints (``lora_checkpoint``), and what a checkpoint records
about itself checked against the run (``identity``: model settings, tokenizer, schedule).

May import ``convert`` (formats and weight maps: ``megatron_layout``, ``hf_io``), ``datasets``, ``data``,
``config``, ``model`` and ``runtime``; never ``training``.
"""
