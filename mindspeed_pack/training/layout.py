"""The layout a run forms (world, parallel sizes, global batch), in one line: the dry run's plan and the training
log's first lines say it alike. Apart from the planner (run_plan), which reads the stages, so the trainer can log it."""
from __future__ import annotations

import os

ROLLOUT_STAGES = ("grpo", "score")  # a micro-batch is one row packed at load time (datasets/rollouts.py)


def packs_at_load_time(args) -> bool:
    """Whether rows are packed at load time (dp_balanced, dynamic CP, rollouts): the global batch counts samples and
    the data decides how many micro-batches they fill, so micro-batch x DP x micro-batches does not describe it."""
    return getattr(args, "sequence_packing_scheduler", "none") != "none" or \
        getattr(args, "stage", None) in ROLLOUT_STAGES


def world_size(args) -> int:
    return args.data_parallel_size * args.tensor_model_parallel_size * args.pipeline_model_parallel_size * \
        args.context_parallel_size


def layout_line(args) -> str:
    """'layout: world 4 (2 nodes x 2 processes) = TP 2 x PP 1 x CP 1 x DP 2 (EP 1); global batch 8 = micro-batch 1
    x DP 2 x 4 micro-batches of 4096 tokens per row': the dry run's plan, and the training log's first lines (as
    Megatron-LM's 'using world size ..., data-parallel size ...'), so a multi-node job shows that every node joined
    and what each step runs. The node count is torchrun's (``GROUP_WORLD_SIZE``), when it started the job."""
    world = world_size(args)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "0") or 0)
    per_node = world // nodes if nodes > 1 and world % nodes == 0 else 0
    where = f" ({nodes} nodes x {per_node} process{'es' if per_node > 1 else ''})" if per_node else ""
    rows = (f"{args.global_batch_size} samples a step on DP {args.data_parallel_size}, packed at load time into "
            f"rows of {getattr(args, 'max_seqlen_per_dp_cp_rank', None) or args.seq_length} tokens per rank (as many "
            "micro-batches as they fill)" if packs_at_load_time(args) else
            f"{args.global_batch_size} = micro-batch {args.micro_batch_size} x DP {args.data_parallel_size} x "
            f"{args.num_micro_batches} micro-batches of {args.seq_length} tokens per row")
    return (f"layout: world {world}{where} = TP {args.tensor_model_parallel_size} x PP "
            f"{args.pipeline_model_parallel_size} x CP {args.context_parallel_size} x DP {args.data_parallel_size} "
            f"(EP {args.expert_model_parallel_size}); global batch {rows}")
