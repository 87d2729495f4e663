"""The load-balancing gradient of one training step, in the trainer and independently with transformers.

Every stage divides its gradient by its own normaliser (tokens, samples, pairs); the aux loss's
gradient must stay ``coeff x grad`` of the step's aux loss whatever it is. Here a real
:class:`~mindspeed_pack.training.trainer.Trainer` (HF ``--load``, any layout) runs one step's
forward and backward over micro-batches given in memory, each stage's own term made exactly zero
(zero advantages; a hinge margin far past 1) or subtracted (SFT: the same step at coeff 0); the
reference is transformers' ``load_balancing_loss_func`` on every sample run alone, averaged as
the step's aux loss is: micro-batches weighted by their routed tokens (``aux_loss``) or samples
(``seq_aux_loss``).
"""

import numpy as np
import torch

from tests.pair_utils import pack_rows, random_pairs
from tests.rollout_utils import random_rollouts

EXPERTS, TOPK = 8, 2
ROW = 96  # tokens of a micro-batch
ROUTER, GATE = "decoder.layers.1.mlp.router.weight", "model.layers.1.mlp.gate.weight"
EMBEDDING, EMBED = "embedding.word_embeddings.weight", "model.embed_tokens.weight"


class StepData:
    """A batch source whose every step is the same given micro-batches (this rank's)."""

    docs: list = []

    def __init__(self):
        self.micro_batches_of_step = []

    def setup(self, args, num_samples):
        pass

    def has_split(self, split):
        return split == "train"

    def step_shape(self, split, consumed):
        return len(self.micro_batches_of_step), ROW, {}

    def micro_batches(self, split, consumed):
        yield from self.micro_batches_of_step


def _sft(seed):
    """Micro-batches of random samples (prompt untrained), as lists of sample token lists."""
    rng = np.random.default_rng(seed)
    out = []
    for lengths in ((19, 7, 26), (12, 30, 5, 9, 1)):  # a 1-token sample last: under CP2 one rank holds only its pads
        ids, labels, seg, samples, pos = np.zeros(ROW, np.int64), np.full(ROW, -100), np.zeros(ROW, np.int64), [], 0
        for k, n in enumerate(lengths, start=1):
            s = rng.integers(3, 256, n)
            ids[pos:pos + n], seg[pos:pos + n] = s, k
            labels[pos + n // 2:pos + n] = s[n // 2:]  # the first half is the prompt
            samples.append(s)
            pos += n
        mb = {"input_ids": torch.from_numpy(ids[None]), "labels": torch.from_numpy(labels[None]),
              "segment_ids": torch.from_numpy(seg[None])}
        out.append((mb, samples))
    return out


def _dpo(seed):
    pairs = random_pairs(5, seed=seed)
    out = []
    for group in ([0, 1], [2, 3, 4]):
        ids, labels, seg = (torch.from_numpy(x) for x in pack_rows(pairs, [group], ROW))
        samples = [np.concatenate([pairs[j][0], answer]) for j in group for answer in pairs[j][1:]]
        out.append(({"input_ids": ids, "labels": labels, "segment_ids": seg}, samples))
    return out


def _grpo(seed):
    from mindspeed_pack.datasets.rollouts import parse_rollout, rollout_row

    rows = random_rollouts(7, seed=seed)
    for row in rows:
        row["advantages"] = [0.0] * len(row["response_ids"])  # the policy term is exactly zero
        for key in ("prompt_ids", "response_ids"):  # transformers' embedding row of the pad id (2) gets no gradient
            row[key] = [3 if t == 2 else t for t in row[key]]
    rollouts = [parse_rollout(row, f"row {i}", 256) for i, row in enumerate(rows)]
    out = []
    for group in ([0, 1, 2], [3, 4, 5, 6]):
        mb = rollout_row([rollouts[i] for i in group], ROW)
        samples = [np.concatenate([rollouts[i].prompt_ids, rollouts[i].response_ids]) for i in group]
        out.append((mb, samples))
    return out


# (name, data, stage factory flags); SFT's own term cannot be zeroed: the step at coeff 0 is subtracted
CASES = {
    "sft token-mean": (_sft, dict(stage="sft", per_sample_loss=False)),
    "sft per-sample": (_sft, dict(stage="sft", per_sample_loss=True)),
    "dpo": (_dpo, dict(stage="dpo")),
    "grpo token-mean": (_grpo, dict(stage="grpo", loss_agg="token-mean")),
    "grpo seq-mean-token-mean": (_grpo, dict(stage="grpo", loss_agg="seq-mean-token-mean")),
    "grpo dr-grpo": (_grpo, dict(stage="grpo", loss_agg="dr-grpo")),
}


def case_micro_batches(name, seed):
    """[(micro-batch dict, [sample ids])] of a case."""
    return CASES[name][0](seed)


def _stage(args, flags):
    from mindspeed_pack.training.stages.dpo import DPOStage
    from mindspeed_pack.training.stages.grpo import GRPOStage
    from mindspeed_pack.training.stages.sequences import pair_segments
    from mindspeed_pack.training.stages.sft import SFTStage

    for k, v in flags.items():
        setattr(args, k, v)
    if args.stage == "sft":
        return SFTStage(args)
    if args.stage == "grpo":
        return GRPOStage(args)

    class MarginPastOne(DPOStage):
        """DPO's hinge loss with a reference that puts every pair's margin far past 1: the loss and its
        gradient are exactly zero."""

        def setup(self, trainer):
            pass

        def prepare(self, trainer, batches, micro_batches, split, tokens_per_micro_batch):
            for b in batches:
                b.ref_logps = torch.tensor([[-1e4, 0.0]] * len(pair_segments(b)[0]))
            return batches

    args.dpo_loss_type, args.dpo_label_smoothing = "hinge", 0.0
    return MarginPastOne(args)


def trainer_aux_grads(trainer, case, micro_batches, routing_type, coeff):
    """(router, embedding, global norm) of the step's gradient that the aux loss adds, in ``trainer``."""
    from mindspeed_pack.model import moe

    trainer.stage = _stage(trainer.args, CASES[case][1])
    trainer.source.micro_batches_of_step = [mb for mb, _ in micro_batches]
    chunk = trainer.model[0]
    for r in moe.routers(chunk):
        r.routing_type = routing_type

    def step(c):
        for r in moe.routers(chunk):
            r.config.moe_aux_loss_coeff = c
        chunk.zero_grad_buffer()
        trainer._run_batches("train", 0, forward_only=False)
        return {n: p.main_grad.detach().double().clone() for n, p in chunk.module.named_parameters()}

    grads = step(coeff)
    if CASES[case][1]["stage"] == "sft":
        without = step(0.0)
        grads = {n: g - without[n] for n, g in grads.items()}
    for r in moe.routers(chunk):
        r.config.moe_aux_loss_coeff = coeff
        r.reset_statistics()
    # expert weights are split over EP ranks and get no aux gradient: the norm over the rest
    dense = {n: g for n, g in grads.items() if ".local_experts." not in n}
    return grads[ROUTER], grads[EMBEDDING], float(torch.sqrt(sum((g ** 2).sum() for g in dense.values())))


def expected_aux_grads(hf, micro_batches, routing_type, coeff):
    """The same from transformers: coeff x grad of the step's aux loss (micro-batches of every rank)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    def lbl(logits):  # megatron's loss is transformers' / top-k (it counts top-k slots)
        return load_balancing_loss_func((logits,), EXPERTS, TOPK) / TOPK

    hf.zero_grad()
    total, units = 0.0, 0
    for _, samples in micro_batches:
        logits = [hf(torch.as_tensor(s)[None], output_router_logits=True).router_logits[0] for s in samples]
        if routing_type == "aux_loss":
            u, loss = sum(len(s) for s in samples), lbl(torch.cat(logits))
        else:
            u, loss = len(samples), sum(lbl(x) for x in logits) / len(samples)
        total, units = total + u * loss, units + u
    (coeff * total / units).backward()
    grads = {n: p.grad.detach().double() for n, p in hf.named_parameters() if p.grad is not None}
    return grads[GATE], grads[EMBED], float(torch.sqrt(sum((g ** 2).sum() for g in grads.values())))


def aux_trainer(hf_dir, flags, world_size=1):
    """A set-up trainer on ``hf_dir`` with the MoE flags, fed by :class:`StepData`."""
    from mindspeed_pack.config.arguments import parse_args, per_split_data_args
    from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size
    from mindspeed_pack.training.stages import stage_args
    from tests.test_moe import QWEN3_MOE_FLAGS
    from tests.train_utils import sft_trainer

    argv = [*QWEN3_MOE_FLAGS, "--load", hf_dir, "--data-path", "unused", "--lr", "0", "--min-lr", "0",
            "--seq-length", str(ROW), "--micro-batch-size", "1", "--global-batch-size", str(2 * world_size),
            "--moe-aux-loss-coeff", "1.0", *flags]
    args = parse_args(argv, extra_args_provider=lambda p: stage_args(per_split_data_args(p)), world_size=world_size)
    resolve_vocab_size(args)
    trainer = sft_trainer(args, StepData())
    trainer.setup()
    return trainer


def rank_aux_grads(hf_dir, flags, cases, routing_types, seed):
    """One rank of a multi-process job: {(case, routing type): aux gradients} over this rank's
    micro-batches (its own seed: ranks hold different data)."""
    import os

    from megatron.core import parallel_state as ps

    trainer = aux_trainer(hf_dir, flags, world_size=int(os.environ["WORLD_SIZE"]))
    mine = seed + ps.get_data_parallel_rank()
    try:
        return {(case, rt): trainer_aux_grads(trainer, case, case_micro_batches(case, mine), rt, 1.0)
                for case in cases for rt in routing_types}
    finally:
        trainer.cleanup()
