"""Preprocess instruction or pretraining data into (packed) Megatron indexed datasets.

    python preprocess_data.py --input data.jsonl --tokenizer-name-or-path TOK \\
        --output-prefix out/alpaca --handler-name AlpacaStyleInstructionHandler \\
        --prompt-type qwen --seq-length 4096 --pack --neat-pack --workers 4

See ``mindspeed_pack/datasets/preprocess.py`` for the pipeline and
``mindspeed_pack/datasets/pack_writer.py`` for the pack layout.
"""
from mindspeed_pack.datasets.preprocess import main

if __name__ == "__main__":
    raise SystemExit(main())
