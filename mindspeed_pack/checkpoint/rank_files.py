"""Where this rank's shard of a checkpoint goes, and whether this rank writes it.

Shared by the Megatron checkpoint code and the Hugging Face export, which stages its shards in
the same layout.
"""
from __future__ import annotations

from megatron.core import parallel_state as ps

from mindspeed_pack.convert import megatron_layout as layout


def tp_pp_ranks() -> tuple:
    """(TP rank, PP rank, PP size): what names a rank's directory without expert parallelism."""
    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_pipeline_model_parallel_world_size())


def rank_dir_name_here() -> str:
    """This rank's ``mp_rank_*`` directory (with its expert-parallel rank when EP > 1)."""
    return layout.rank_dir_name(*tp_pp_ranks(), ps.get_expert_model_parallel_rank(),
                                ps.get_expert_model_parallel_world_size())


def is_shard_writer() -> bool:
    """One writer per saved shard: data-parallel rank 0 of its TP x PP (x EP) position. Under expert
    parallelism the expert-data-parallel group is the one whose ranks hold the same experts."""
    if ps.get_expert_model_parallel_world_size() > 1:
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0
