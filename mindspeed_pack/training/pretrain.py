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
    pretrain_gpt.py --train-data-path 0.3 A 0.7 B --valid-data-path V [--test-data-path T] ...
        (Megatron-LM's per-split data: each split its own prefix or blend, used whole; no --split)

The EOD id and vocabulary size default to what preprocess_data.py recorded in
``P_text_meta.json`` next to the documents.
"""
import os
import sys
import warnings

from mindspeed_pack.config import resolved_config
from mindspeed_pack.config.arguments import parse_args, per_split_data_args
from mindspeed_pack.config.errors import flag_scope
from mindspeed_pack.datasets.packed_documents import DataError
from mindspeed_pack.datasets.pretrain_dataset import (
    GPTBatchSource,
    all_prefixes,
    check_prefix_files,
    resolve_pretrain_vocab_size,
)
from mindspeed_pack.runtime import error_scope
from mindspeed_pack.runtime.error_scope import scoped
from mindspeed_pack.training import raw_data, run_plan
from mindspeed_pack.training.cli import run_cli, setup_logging
from mindspeed_pack.training.stages.sft import SFTStage
from mindspeed_pack.training.trainer import run


def pretrain_args(parser):
    g = parser.add_argument_group("pretraining data")
    g.add_argument("--eod-id", type=int, default=None,
                   help="end-of-document token id (default: the tokenizer's EOS)")
    parser.set_defaults(pretraining=True)  # no fine-tuning defaults from a Hugging Face --load (finetune_defaults.py)
    return raw_data.raw_data_args(per_split_data_args(parser, pretrain=True), pretrain=True)


def main(argv=None):
    setup_logging()
    args = parse_args(argv, extra_args_provider=pretrain_args,
                      description="mindspeed-pack pretraining on indexed documents")
    if args.reset_position_ids and not args.isolate_segments and args.position_embedding_type == "rope":
        warnings.warn("--reset-position-ids without --reset-attention-mask under RoPE changes nothing: rotary "
                      "positions restart per attention sequence, here the whole row (as in Megatron-LM); add "
                      "--reset-attention-mask to restart them per document", stacklevel=1)
    if args.no_shuffle:
        warnings.warn("--no-shuffle is ignored: GPTDataset draws Megatron-LM's seeded order", stacklevel=1)
    raw_data.prepare(args, pretrain=True)  # raw --data-path (or per-split) files -> documents, once (rank 0)
    if (args.valid_data_path or args.test_data_path) and not args.train_data_path and not args.skip_train:
        raise scoped(DataError("--valid-data-path/--test-data-path without --train-data-path: give the training "
                               "data as --train-data-path (or --skip-train to evaluate only)"), flag_scope(args))
    resolve_pretrain_vocab_size(args)
    if run_plan.dry_run(args, "pretrain_gpt.py"):
        return None
    with error_scope.files_read_alike(DataError):  # every rank checks the same files: one line per node
        check_prefix_files(all_prefixes(args))  # a typo is refused before the model is built
    run_plan.check_host_memory(args)  # on a CPU: a model that cannot fit stops here, not OOM-killed
    return run(args, GPTBatchSource(), SFTStage(args),
               before_train=lambda trainer: resolved_config.write(args, "pretrain_gpt.py"))



def cli() -> None:
    """The ``pretrain_gpt.py`` command (also installed as a console script): :func:`main` with one-line errors."""
    run_cli(os.path.basename(sys.argv[0]) or "pretrain_gpt.py", main, own_process=True)


if __name__ == "__main__":  # python -m / torchrun -m (it printed nothing and exited 0)
    cli()
