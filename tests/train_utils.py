"""Tiny packed datasets and posttrain runs for the training tests."""
import json
import os

from tests.data_utils import write_packed_instruction_dataset
from tests.model_utils import TINY_FLAGS
from tests.preloaded import ROOT, run_script


def write_copy_task(prefix, num_packs=48, seq_length=128, seed=0, neat_pack=True, meta=True):
    """Packs of samples whose second half repeats the first (learnable), with the sidecar."""
    return write_packed_instruction_dataset(prefix, num_packs=num_packs, seq_length=seq_length, seed=seed,
                                            neat_pack=neat_pack, meta=meta)


# a one-step run's own flags; a HF --load takes the model's shape from config.json. The schedule is given in
# full, so a HF run gets no fine-tuning default (finetune_defaults.py) a converted checkpoint's run would not get
RUN_FLAGS = ["--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4", "--neat-pack",
             "--train-iters", "1", "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant",
             "--lr-warmup-iters", "0",
             "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--log-interval", "1", "--eval-iters", "0"]


def tiny_argv(data, *extra):
    """posttrain flags of a one-step tiny --neat-pack run on ``data`` (in-process tests)."""
    return [*TINY_FLAGS, "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--neat-pack", "--train-iters", "1", "--data-path", data, *extra]


def run_posttrain(extra, nproc=1, metrics=None, timeout=600, check=True, env=None, script="posttrain.py",
                  model_flags=TINY_FLAGS):
    """Run posttrain.py (or ``script``, e.g. pretrain_gpt.py; ``nproc`` ranks as torchrun starts them) with the
    tiny model (``model_flags``, another family's flags for its tests) in preloaded processes
    (:mod:`tests.preloaded`); returns (completed process, metrics records)."""
    argv = [*model_flags, *extra] + (["--metrics-file", metrics] if metrics else [])
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = run_script(script, argv, nproc=nproc, env=full_env, cwd=ROOT, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    records = []
    if metrics and os.path.exists(metrics):
        with open(metrics) as f:
            # the run's precision record (split "setup") comes first: callers here want the steps
            records = [r for r in (json.loads(line) for line in f if line.strip()) if r.get("split") != "setup"]
    return proc, records


def run_posttrain_runs(runs, nproc=1, timeout=600, env=None, model_flags=TINY_FLAGS):
    """Several posttrain.py runs one after the other in the same ``nproc`` processes: one job, started once,
    its process groups made once, so every run has the same parallel layout (e.g. one layout's DPO, SimPO and
    ORPO runs). ``runs``: [(argv, metrics file)]. Returns (the job's completed process, each run's records)."""
    argvs = [[*model_flags, *argv, "--metrics-file", metrics] for argv, metrics in runs]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = run_script("posttrain.py", argvs[0], nproc=nproc, env=full_env, cwd=ROOT, timeout=timeout, then=argvs[1:])
    if proc.returncode != 0:
        raise AssertionError(f"posttrain.py runs failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    records = []
    for _, metrics in runs:
        with open(metrics) as f:
            records.append([r for r in (json.loads(line) for line in f if line.strip()) if r.get("split") != "setup"])
    return proc, records


def train_losses(records):
    return [r["lm loss"] for r in records if r["split"] == "train"]


def first_loss(argv, metrics):
    """The first step's loss of an in-process ``posttrain.py`` run (``argv``, metrics written to ``metrics``)."""
    import posttrain

    posttrain.main([*argv, "--metrics-file", metrics])
    with open(metrics) as f:
        return train_losses(json.loads(line) for line in f if line.strip())[0]


def trainer_steps(argv: list) -> list:
    """The logged records of a posttrain run's steps (``argv``: its whole command line), trained in this process
    (a rank of a :func:`tests.dist_harness.run_distributed` job); the trainer is cleaned up."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size
    from mindspeed_pack.training.stages import get_stage, stage_args
    from mindspeed_pack.training.trainer import Trainer

    args = parse_args(argv, extra_args_provider=stage_args)
    resolve_vocab_size(args)
    stage = get_stage(args)
    trainer = Trainer(args, stage.batch_source(args), stage)
    trainer.setup()
    try:
        for chunk in trainer.model:
            chunk.train()
        records = [trainer.train_iteration() for _ in range(args.train_iters)]
        if args.save:
            trainer.save()
    finally:
        trainer.cleanup()
    return records


def sft_trainer(args, batch_source):
    """A :class:`Trainer` of the SFT stage, as ``posttrain.py`` builds it for ``--stage sft``."""
    from mindspeed_pack.training.stages.sft import SFTStage
    from mindspeed_pack.training.trainer import Trainer

    return Trainer(args, batch_source, SFTStage(args))


def copy_task_and_tiny_qwen2(root) -> tuple:
    """A 16-pack copy task and a tiny Qwen2 (its HF directory, converted beside it) under ``root``:
    (the data prefix, the HF directory), for jobs that train from scratch and with ``--load HF_DIR``."""
    from tests.model_utils import write_converted_tiny_qwen2

    write_converted_tiny_qwen2(root / "qwen")
    return write_copy_task(str(root / "copy"), num_packs=16), str(root / "qwen" / "hf")
