"""The run's settings: one argument parser with Megatron-LM's and MindSpeed-LLM's flags (``arguments``),
YAML config files read as the same flags (``yaml_file``), the model flags a Hugging Face ``--load``
supplies (``hf_flags``), those a Megatron ``--load`` records (``checkpoint_flags``) and the LoRA flags a
PEFT ``--lora-load`` directory states (``peft_flags``), the fine-tuning
defaults of the one-command form (``finetune_defaults``) and the resolved configuration written beside a
run's outputs (``resolved_config``).

May import ``convert``, ``model`` and ``runtime``; never the data, checkpoint or training packages
(preprocessing reads its ``--config`` file through ``yaml_file``).
"""
