"""Checkpoint formats and conversion between them: Hugging Face directories (``hf_io``), Megatron's on-disk
layout (``megatron_layout``), the model families as data (``model_specs``, ``weight_map``), TP/PP/EP
sharding (``sharding``), PEFT adapters (``adapters``), a LoRA run's checkpoint at another layout
(``adapter_reshard``) and ``convert_ckpt.py``'s pipeline (``convert``).

May import ``model`` and ``runtime``; the training run's checkpoints (``checkpoint``) build on it.
"""
from mindspeed_pack.convert.convert import hf_to_megatron, megatron_to_hf, megatron_to_megatron
from mindspeed_pack.convert.model_specs import ConversionError, args_from_hf_config
from mindspeed_pack.convert.sharding import layer_offset, merge_state_dicts, shard_state_dict

__all__ = [
    "ConversionError", "args_from_hf_config", "hf_to_megatron", "layer_offset", "megatron_to_hf",
    "megatron_to_megatron", "merge_state_dicts", "shard_state_dict",
]
