"""The checkpoint a run starts from: ``--load`` as it is, under LoRA the frozen base and then ``--lora-load``'s
adapters, or the run's own ``--save``. The trainer calls :func:`load_run_checkpoint` and never asks which.

A run that starts from weights at iteration 0 (``--load HF_DIR``, ``--finetune``, a release checkpoint; under
LoRA fresh adapters, ``--lora-load D --finetune`` or a PEFT directory's adapters) and saves elsewhere (``--save S``) repeats that start when
it is run again: torchrun's restart after a crash, or the same command by hand. It resumes from S instead when
S holds *this run's* checkpoint (HF Trainer's ``resume_from_checkpoint``, LLaMA-Factory and ms-swift do the
same): ``S/run_config.yaml`` records the same value of every flag that defines the run (model, data, schedule,
layout: :func:`~mindspeed_pack.config.resolved_config.run_differences`; where it writes and how often it logs
may differ). A checkpoint of another run, or one without a record, is refused, naming the flags that differ.
``--finetune`` from S itself (``--load S --save S``, as a config file's ``finetune: true`` gives it) resumes S when
it holds this run's checkpoint, and is refused on another run's, whose iterations its restart would save over.
``--overwrite-output-dir`` starts over instead, removing S's checkpoints, on the job's first attempt only
(torchrun's restarts then resume what the job saved).
"""
from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from mindspeed_pack.checkpoint import hf_checkpoint, lora_checkpoint, save_load
from mindspeed_pack.checkpoint.errors import CheckpointError
from mindspeed_pack.config import finetune_defaults, resolved_config
from mindspeed_pack.convert import adapters
from mindspeed_pack.convert import megatron_layout as layout
from mindspeed_pack.model import lora
from mindspeed_pack.runtime import error_scope, faults
from mindspeed_pack.runtime.error_scope import scoped
from mindspeed_pack.runtime.platform import cuda_usable, node_and_host

log = logging.getLogger(__name__)


def load_run_checkpoint(args, model, optimizer, scheduler, resume_save: bool = True) -> tuple:
    """(iteration, consumed samples) the run resumes at, after loading what it starts from (``resume_save``:
    its own ``--save`` when it holds this run's checkpoint)."""
    with error_scope.files_read_alike(CheckpointError):  # --save's record, read alike by every rank
        save = _own_checkpoint(args) if resume_save else None
    args.resumed_from = save
    if lora.trains_adapters(args):
        position = lora_checkpoint.load_checkpoint(args, model, optimizer, scheduler, adapters_root=save)
    elif save:
        position = save_load.load_checkpoint(args, model, optimizer, scheduler, root=save, flag="--save",
                                             weights_only=False)
    else:
        position = save_load.load_checkpoint(args, model, optimizer, scheduler)
    _check_ranks_agree(args, position)
    return position


def _check_ranks_agree(args, position: tuple) -> None:
    """Every rank resumes at the same (iteration, consumed samples): ranks that read different trackers (a
    ``--save`` on disks the nodes do not share) would otherwise train from different steps."""
    mine = torch.tensor([float(position[0]), float(position[1])], dtype=torch.float64,
                        device=torch.cuda.current_device() if cuda_usable() else "cpu")
    both = torch.cat([-mine, mine])  # one MAX gives the lowest and the highest
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    low, high = (-both[:2]).cpu(), both[2:].cpu()
    if torch.equal(low, high):
        return
    found = [None] * dist.get_world_size()  # only now: which rank found which, and where it runs
    dist.all_gather_object(found, (position[0], *node_and_host()))
    # every rank gathered the same: rank 0 says it for the job
    raise scoped(CheckpointError(f"the ranks found different checkpoints to resume in {loaded_from(args)}: "
                                 f"{_found_by_node(found)}; it must be one directory every node sees (a shared "
                                 "filesystem, or the same files copied to every node; with --no-shared-storage too: it "
                                 "covers the data, not the checkpoints)"), "job")


def _found_by_node(found: list) -> str:
    """'node 0 (host a, rank 0): iteration 3; node 1 (host b, rank 1): no checkpoint' from every rank's
    (iteration, node, host), ranks that found the same on one node together."""
    groups: dict = {}
    for rank, (iteration, node, host) in enumerate(found):
        groups.setdefault((node, host, iteration), []).append(rank)
    parts = []
    for (node, host, iteration), ranks in groups.items():
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}" \
            if ranks == list(range(ranks[0], ranks[-1] + 1)) else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"node {node} (host {host}, {which}): "
                     f"{f'iteration {iteration}' if iteration else 'no checkpoint (starts from scratch)'}")
    return "; ".join(parts[:8]) + (f"; and {len(parts) - 8} more" if len(parts) > 8 else "")


def loaded_from(args) -> str:
    """The checkpoint the iteration and data position came from (LoRA: the adapters' checkpoint)."""
    return getattr(args, "resumed_from", None) or args.lora_load or args.load


def resumed_own_save(args) -> bool:
    """Whether the run resumed from its own ``--save``: its ``--load`` then still holds the weights it started
    from (a reference model of the starting policy reads them again)."""
    return bool(getattr(args, "resumed_from", None))


def _same_dir(a, b) -> bool:
    return bool(a and b) and os.path.abspath(a) == os.path.abspath(b)


def _is_release(path: str) -> bool:
    try:
        return layout.read_tracker(path) == layout.RELEASE
    except ValueError:
        return False  # the loader names the unreadable tracker


def starts_from_weights(args) -> bool:
    """Whether the run starts at iteration 0 from weights it does not save over: its ``--save`` is then the
    only place its progress is (the case :func:`_own_checkpoint` resumes)."""
    if lora.trains_adapters(args):  # a PEFT directory's adapters are weights, loaded at iteration 0
        source = args.lora_load
        fresh = not source or args.finetune or adapters.is_peft_dir(source)
    else:
        source = args.load
        fresh = args.finetune or hf_checkpoint.loads_hf(args) or bool(args.load and _is_release(args.load))
    return bool(args.save) and fresh and not _same_dir(source, args.save)


def _finetune_in_place(args, save: str) -> Optional[str]:
    """``--finetune`` from ``--save`` itself (``--load D --save D``; LoRA: ``--lora-load D``): ``D`` at a training
    iteration holds this run's progress when its record says so (resumed, as the same command with another
    ``--load`` would be), else another run's, which ``--finetune``'s restart at iteration 0 would save over:
    refused. A release checkpoint (a conversion) is fine-tuned from, once."""
    try:
        tracked = layout.read_tracker(save)
    except ValueError as e:
        raise CheckpointError(f"--save {save}: {e}") from None
    if tracked is None or tracked == layout.RELEASE:
        return None
    differing = resolved_config.run_differences(args, save)
    if differing == []:
        if dist.get_rank() == 0:
            log.info("--save %s holds iteration %s of this run (%s records the same flags): resuming from it, not "
                     "restarting at iteration 0 (--finetune reads a checkpoint of another run)", save, tracked,
                     resolved_config.FILE_NAME)
        return save
    source = "--lora-load" if lora.trains_adapters(args) else "--load"
    why = (f"another run's ({os.path.join(save, resolved_config.FILE_NAME)}: {'; '.join(differing)})" if differing
           else "a run's with no readable record")
    raise CheckpointError(f"--finetune {source} {save} --save {save}: {save} holds iteration {tracked} of {why}; "
                          f"--finetune restarts at iteration 0 and would save over its iterations: pass another --save "
                          f"to fine-tune from it, or leave out --finetune (a config file's 'finetune: true' too) to "
                          "resume it")


def _own_checkpoint(args) -> Optional[str]:
    """``--save`` when the run resumes from it (it holds this run's checkpoint), else None; refuses another
    run's checkpoint there, and starts over in it under ``--overwrite-output-dir``."""
    save = args.save
    if not save or not os.path.isdir(save) or args.skip_train:  # an evaluation saves nothing
        return None
    fresh = starts_from_weights(args)
    if not fresh and not args.overwrite_output_dir:
        if args.finetune:
            return _finetune_in_place(args, save)
        return None  # --load D --save D resumes D itself (save_load.load_checkpoint)
    try:
        tracked = layout.read_tracker(save)
    except ValueError as e:
        raise CheckpointError(f"--save {save}: {e}") from None
    differing = resolved_config.run_differences(args, save) if tracked is not None else None
    same_run = differing == []
    if args.overwrite_output_dir and not (faults.restart_attempt() and same_run):
        _refuse_removing_the_load(args, save, tracked)
        _start_over(args, save)
        return None
    if not fresh:
        return None
    if tracked is None:
        save_load.uncommitted_iterations(save, "--save")  # several without a tracker: refused
        return None  # nothing saved yet, or an interrupted first save (saved over)
    if same_run:
        if dist.get_rank() == 0:
            log.info("--save %s holds iteration %s of this run (%s records the same flags): resuming from it "
                     "(--overwrite-output-dir starts over)", save, tracked, resolved_config.FILE_NAME)
        return save  # an export in SAVE/hf: written again or not once the iteration is known (trainer.run)
    record = os.path.join(save, resolved_config.FILE_NAME)
    source = "--lora-load" if lora.trains_adapters(args) else "--load"
    what = (f"of another run ({record}: {'; '.join(differing)}): pass the flags it was run with to resume it, "
            f"{source} {save} to resume it with these (Megatron-LM's resume: another --micro-batch-size or data-parallel "
            "size goes on exactly; another schedule needs --override-opt_param-scheduler or "
            "--use-checkpoint-opt_param-scheduler)"
            if differing else f"but no readable {record} says which run wrote it: pass --load {save} (with the model flags) to "
            "resume it")
    raise CheckpointError(f"--save {save} holds iteration {tracked} {what}, another --save, or --overwrite-output-dir "
                          f"to start over in {save} (its checkpoints are removed)")


def _refuse_removing_the_load(args, save: str, tracked) -> None:
    """``--overwrite-output-dir`` with ``--load D --save D`` (LoRA: ``--lora-load D``): starting over in ``D`` removed
    the checkpoint the run was to load, and the run then trained from scratch (warned only)."""
    flag, source = ("--lora-load", args.lora_load) if lora.trains_adapters(args) else ("--load", args.load)
    if tracked is not None and _same_dir(source, save):
        raise CheckpointError(f"--overwrite-output-dir removes the checkpoints of --save {save}, which {flag} {source} "
                              f"loads (iteration {tracked}): the run would start from scratch; pass another --save to "
                              "start over from its weights, or leave out --overwrite-output-dir to resume it")


def _start_over(args, save: str) -> None:
    """``--overwrite-output-dir``: remove what runs write into ``save`` (checkpoints, tracker, resolved
    configuration, the fine-tuning default export), rank 0, before this run writes anything there."""
    export = os.path.join(save, finetune_defaults.SAVE_HF_SUBDIR)
    paths = [os.path.join(save, layout.TRACKER), os.path.join(save, resolved_config.FILE_NAME),
             *sorted(glob.glob(os.path.join(save, "iter_*"))),
             *([export] if _same_dir(args.save_hf, export) else [])]
    found = [p for p in paths if os.path.lexists(p)]
    if found and dist.get_rank() == 0:
        log.warning("--overwrite-output-dir: starting over in --save %s, removing %s", save,
                    ", ".join(os.path.basename(p) for p in found))
        for path in found:
            if os.path.isdir(path) and not os.path.islink(path):
                layout.remove_tree(path)
            else:
                os.remove(path)
    dist.barrier()
