"""Supervised fine-tuning on packed instruction data (MindSpeed-LLM's posttrain_gpt.py).

    torchrun --nproc-per-node N posttrain.py --data-path P --neat-pack ... (Megatron-LM flags)
    posttrain.py --train-data-path P --valid-data-path V ...   (a separately preprocessed validation set)
"""
from mindspeed_pack.data.online_packing import batch_source
from mindspeed_pack.data.packed_dataset import resolve_vocab_size
from mindspeed_pack.training.arguments import parse_args, per_split_data_args
from mindspeed_pack.training.cli import run_cli, setup_logging
from mindspeed_pack.training.trainer import run


def main(argv=None):
    setup_logging()
    args = parse_args(argv, extra_args_provider=per_split_data_args,
                      description="mindspeed-pack supervised fine-tuning on packed data")
    resolve_vocab_size(args)
    return run(args, batch_source(args))


if __name__ == "__main__":
    run_cli("posttrain.py", main)
