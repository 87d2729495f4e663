"""Convert checkpoints between Hugging Face and Megatron, or reshard Megatron ones.

    python convert_ckpt.py --load-model-type hf --save-model-type mg \
        --load-dir Qwen2.5-7B --save-dir qwen-mg-tp4 --target-tensor-parallel-size 4

See :mod:`mindspeed_pack.convert.convert` for what is written and checked.
"""
import sys

from mindspeed_pack.convert.convert import main

if __name__ == "__main__":
    sys.exit(main())
