"""Supervised fine-tuning on packed instruction data (MindSpeed-LLM's posttrain_gpt.py).

    torchrun --nproc-per-node N posttrain.py --data-path P --neat-pack ... (Megatron-LM flags)
"""
import logging
import sys

from mindspeed_pack.data.packed_dataset import PackedBatchSource, resolve_vocab_size
from mindspeed_pack.training.arguments import parse_args
from mindspeed_pack.training.trainer import run


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # keep the console for our step lines
    args = parse_args(argv, description="mindspeed-pack supervised fine-tuning on packed data")
    resolve_vocab_size(args)
    run(args, PackedBatchSource())


if __name__ == "__main__":
    sys.exit(main())
