"""Post-training on packed data (MindSpeed-LLM's posttrain_gpt.py): ``--stage sft`` (default), ``dpo``, ``simpo``,
``orpo``, ``kto``, ``grpo``, ``orm``, ``prm``.

    torchrun --nproc-per-node N posttrain.py --data-path P --neat-pack ... (Megatron-LM flags)
    posttrain.py --load HF_DIR --data-path data.jsonl --handler-name ... --prompt-type qwen --neat-pack \
        --seq-length 4096 --train-epochs 2 ...   (raw files: tokenised and packed first, once, then trained)
    posttrain.py --config run.yaml [--flag value ...]   (flags from a YAML file; the command line overrides it)
    posttrain.py --train-data-path P --valid-data-path V ...   (a separately preprocessed validation set)
    posttrain.py --stage dpo --dpo-beta 0.1 --data-path PAIRS ...   (preference pairs; see README)
    posttrain.py --stage simpo|orpo --data-path PAIRS ...   (preference pairs, no reference model)
    posttrain.py --stage score|grpo --rollout-path ROLLOUTS.jsonl ...   (RL rollouts; see README)
    posttrain.py --stage orm|prm --data-path P ...   (outcome / process reward models; see README)
"""
# the script's code lives in the package (console script mindspeed-posttrain); tests import main from here
from mindspeed_pack.training.posttrain import cli, main, posttrain_args  # noqa: F401

if __name__ == "__main__":
    cli()
