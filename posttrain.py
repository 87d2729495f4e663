"""Post-training on packed data (MindSpeed-LLM's posttrain_gpt.py): ``--stage sft`` (default), ``dpo``, ``grpo``.

    torchrun --nproc-per-node N posttrain.py --data-path P --neat-pack ... (Megatron-LM flags)
    posttrain.py --train-data-path P --valid-data-path V ...   (a separately preprocessed validation set)
    posttrain.py --stage dpo --dpo-beta 0.1 --data-path PAIRS ...   (preference pairs; see README)
    posttrain.py --stage score|grpo --rollout-path ROLLOUTS.jsonl ...   (RL rollouts; see README)
"""
from mindspeed_pack.data.packed_dataset import resolve_vocab_size
from mindspeed_pack.training.arguments import parse_args, per_split_data_args
from mindspeed_pack.training.cli import run_cli, setup_logging
from mindspeed_pack.training.stages import get_stage, stage_args
from mindspeed_pack.training.trainer import run


def main(argv=None):
    setup_logging()
    args = parse_args(argv, extra_args_provider=lambda p: stage_args(per_split_data_args(p)),
                      description="mindspeed-pack post-training (SFT, DPO, GRPO) on packed data")
    resolve_vocab_size(args)
    stage = get_stage(args)
    if hasattr(stage, "run"):  # a pass that is not a training loop (scoring)
        return stage.run(args)
    return run(args, stage.batch_source(args), stage=stage)


if __name__ == "__main__":
    run_cli("posttrain.py", main)
