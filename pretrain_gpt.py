"""Pretraining on plain documents (Megatron-LM's pretrain_gpt.py), same loop as posttrain.py.

    torchrun --nproc-per-node N pretrain_gpt.py --data-path [W1] P1_text_document [W2 P2 ...] \
        [--tokenizer-name-or-path TOK | --eod-id ID --vocab-size V] \
        --reset-attention-mask --reset-position-ids [--eod-mask-loss] ... (Megatron-LM flags)
    pretrain_gpt.py --config run.yaml [--flag value ...]   (flags from a YAML file; the command line overrides it)
    torchrun ... pretrain_gpt.py --data-path corpus.jsonl --tokenizer-name-or-path TOK --append-eod ...
        (raw files, any format preprocess_data.py reads: tokenised into documents first, once, and cached;
        --handler-name GeneralPretrainHandler, as MindSpeed-LLM's pretrain scripts pass it)
    pretrain_gpt.py --data-path 0.3 a.jsonl 0.7 b.jsonl --append-eod ...
        (a weighted blend of raw files: each tokenised into its own cached documents, then blended)

The EOD id and vocabulary size default to what preprocess_data.py recorded in
``P_text_meta.json`` next to the documents.
"""
# the script's code lives in the package (console script mindspeed-pretrain); tests import main from here
from mindspeed_pack.training.pretrain import cli, main, pretrain_args  # noqa: F401

if __name__ == "__main__":
    cli()
