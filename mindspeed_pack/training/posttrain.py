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
import os
import sys

from mindspeed_pack.config import resolved_config
from mindspeed_pack.config.arguments import parse_args, per_split_data_args
from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size
from mindspeed_pack.datasets.packed_documents import DataError
from mindspeed_pack.runtime import error_scope
from mindspeed_pack.training import raw_data, run_plan
from mindspeed_pack.training.cli import run_cli, setup_logging
from mindspeed_pack.training.stages import check_stage_flags, data_layouts, get_stage, stage_args
from mindspeed_pack.training.trainer import run


def posttrain_args(parser):
    """posttrain.py's flags beyond the shared ones: stages, per-split data, raw data files, epochs."""
    return run_plan.train_epochs_arg(raw_data.raw_data_args(stage_args(per_split_data_args(parser))))


def main(argv=None):
    setup_logging()
    args = parse_args(argv, extra_args_provider=posttrain_args,
                      description="mindspeed-pack post-training (SFT, DPO, SimPO, ORPO, KTO, GRPO, reward models) on packed data")
    check_stage_flags(args)  # before raw files are tokenised and packed
    raw_data.prepare(args)  # raw --data-path files -> packs, once (rank 0); every rank trains on them
    resolve_vocab_size(args)
    run_plan.resolve_epochs(args)  # --train-epochs -> --train-iters
    stage = get_stage(args)  # its own flag checks, under --dry-run too
    if args.dry_run:
        data_layouts.check_data_paths(args)  # what the stage's setup would refuse (the data may come later)
    if run_plan.dry_run(args, "posttrain.py"):
        return None
    run_plan.check_host_memory(args)  # on a CPU: a model that cannot fit stops here, not OOM-killed
    with error_scope.files_read_alike(DataError):  # every rank checks the same files: one line per node
        data_layouts.check_data_paths(args, required=True)  # and a missing prefix, not after the model is built
    if hasattr(stage, "run"):  # a pass that is not a training loop (scoring)
        return stage.run(args)
    # the resolved configuration once the run is set up (a run that fails to start overwrites nothing)
    return run(args, stage.batch_source(args), stage,
               before_train=lambda trainer: resolved_config.write(args, "posttrain.py"))


def cli() -> None:
    """The ``posttrain.py`` command (also installed as a console script): :func:`main` with one-line errors."""
    run_cli(os.path.basename(sys.argv[0]) or "posttrain.py", main, own_process=True)


if __name__ == "__main__":  # python -m / torchrun -m (it printed nothing and exited 0)
    cli()
