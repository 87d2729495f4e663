"""Per-token log-probs of rollouts under a checkpoint (``posttrain.py --stage score``).

``posttrain.py --stage score --load CKPT --rollout-path IN.jsonl --score-output OUT.jsonl
--score-field old_logprobs`` runs ``--load`` forward over the rollouts, packed as ``--stage grpo``
packs them (:class:`~mindspeed_pack.datasets.rollouts.RolloutBatchSource`, any TP/PP/CP/DP layout),
and writes every row back with the log-prob of each response token under ``--score-field``
(``old_logprobs`` for the sampling policy, ``ref_logprobs`` for the reference), rows in input
order; ``--score-entropy`` adds ``entropy``, the policy's entropy where each response token is
predicted (from the full vocab-parallel logits). Under context parallelism every rank scores its
zigzag share of each row and the CP group puts the tokens back together before writing; under
``--sequence-packing-scheduler default_dynamic_cp`` each rollout is scored on the smallest CP group that holds
it, as ``--stage grpo`` trains it. The forward pass is the reference scorer's (:func:`.reference.score_batches`).

With an outcome reward model as ``--load`` (``--stage orm``'s, or a transformers
``*ForSequenceClassification`` directory) each row gets ``reward`` instead: the score head at the
rollout's last token that is not the model's pad token, as ``--stage orm`` reads it and
transformers pools it (the scalar ``reward`` that ``--stage grpo`` turns into advantages with ``group``).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing import context_parallel as cp_view
from mindspeed_pack.packing.segments import reward_positions
from mindspeed_pack.runtime import stale_files
from mindspeed_pack.training.stages.reference import ReferenceScoringStage

log = logging.getLogger(__name__)


class ScoreStage(ReferenceScoringStage):
    """``--stage score``: one forward pass over every rollout (the reference scorer's run); no training."""

    name = "score"

    def __init__(self, args):
        super().__init__(args)
        self.entropy = bool(getattr(args, "score_entropy", False))
        self.reward = bool(getattr(args, "reward_head", False))  # --load is an outcome reward model
        if self.reward and self.entropy:
            raise DataError(f"--score-entropy: --load {args.load} is an outcome reward model (a scalar score head, no "
                            "token distribution); drop --score-entropy")
        self.fields = ("reward",) if self.reward else (args.score_field,) + (("entropy",) if self.entropy else ())

    def batch_source(self, args):
        from mindspeed_pack.datasets.rollouts import RolloutBatchSource

        return RolloutBatchSource(need_advantages=False)

    def check(self, args) -> None:
        from mindspeed_pack.datasets.rollouts import rollout_file_format

        super().check(args)
        if not args.score_output:
            raise DataError("--stage score needs --score-output (a .jsonl or .parquet file)")
        rollout_file_format(args.score_output)

    def score(self, trainer) -> dict:
        """{rollout index: {field: values of its response tokens}} of this rank, gathered and written on one rank.

        Each row is scored where the plan puts it: split over megatron's CP group, or under dynamic CP over the
        row's own group (alone on one rank); the group puts its tokens back together and its first rank keeps
        them. Dynamic CP gives every rank of the data x context parallel pool its own rows, so the writer gathers
        the table over the pool."""
        from mindspeed_pack.runtime.process_groups import dynamic_cp_group
        from mindspeed_pack.training.batches import to_packed_batch
        from mindspeed_pack.training.stages.reference import score_batches

        args, source = self.args, trainer.source
        cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        tp, sp = args.tensor_model_parallel_size, args.sequence_parallel
        n = len(source.rollouts)
        per_step = args.global_batch_size
        mine = {}
        for start in range(0, n, per_step):
            rows, _ = source.plan(np.arange(start, min(n, start + per_step)))
            raw = [source.row(row, every_response_token=True) for row in rows]
            views, tokens = [to_packed_batch(mb, args) for mb in raw], source.capacity
            if source.dynamic_cp:  # each row on its own group, this rank's share of it
                views = [cp_view.group_view(v, row.cp_size, row.cp_rank, cp_view.padding_multiple(row.cp_size, tp, sp),
                                            row.cp_size * source.max_tokens_per_cp_rank)
                         for v, row in zip(views, rows)]
            elif cp > 1:  # this rank's zigzag share of every row, as training splits it
                views, tokens = cp_view.step_views(views, cp, cp_rank, cp_view.padding_multiple(cp, tp, sp),
                                                   same_length=ps.get_pipeline_model_parallel_world_size() > 1,
                                                   max_per_rank=source.max_tokens_per_cp_rank)
            # every DP rank runs the same number of rows (empty ones where it has fewer samples)
            scored = score_batches(trainer.model, views, tokens, self.token_values, needs_logits=self.entropy)
            for row, mb, view, values in zip(rows, raw, views, scored):
                if values is None:
                    continue
                values = values.reshape(len(self.fields), -1)
                size, rank = (row.cp_size, row.cp_rank) if source.dynamic_cp else (cp, cp_rank)
                if size > 1:  # every token back where the row holds it
                    group = dynamic_cp_group(size) if source.dynamic_cp else ps.get_context_parallel_group()
                    shares = [torch.empty_like(values) for _ in range(size)]
                    dist.all_gather(shares, values.contiguous(), group=group)
                    values = cp_view.whole_from_shares(shares, view, mb["input_ids"].shape[1])
                if source.dynamic_cp and rank:  # the row's group keeps it once, on its first rank
                    continue
                values = values.cpu()
                for i, first in zip(row.rollouts, mb["response_starts"]):
                    rollout = source.rollouts[int(i)]
                    if self.reward:
                        mine[int(i)] = {"reward": float(values[0, self.reward_position(rollout, first)])}
                        continue
                    end = first + len(rollout.response_ids)
                    mine[int(i)] = {f: values[k, first:end].tolist() for k, f in enumerate(self.fields)}
        writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            (source.dynamic_cp or cp_rank == 0)
        if writer:
            group = ps.get_data_parallel_group(with_context_parallel=source.dynamic_cp)
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            if dist.get_rank(group) == 0:
                table = {}
                for part in gathered:
                    table.update(part)
                self.write(source.rollouts, table)
        dist.barrier()
        return mine

    def reward_position(self, rollout, response_start: int) -> int:
        """Where in its row a rollout's reward is read (``response_start``: the position predicting its first
        response token): its last token that is not the model's pad token."""
        ids = torch.from_numpy(np.concatenate([rollout.prompt_ids, rollout.response_ids]))[None]
        at = int(torch.argmax(reward_positions(ids, torch.ones_like(ids), self.args.reward_pad_token_id)))
        return response_start - len(rollout.prompt_ids) + 1 + at

    def token_values(self, batch, output_tensor: torch.Tensor) -> torch.Tensor:
        """[fields, T]: the log-prob of every position's target (and the policy's entropy there); a reward
        model's per-token rewards."""
        from mindspeed_pack.training.stages.grpo import vocab_parallel_logp_entropy
        from mindspeed_pack.training.stages.reference import token_logps

        if self.reward:
            return output_tensor.float().reshape(1, -1)
        if not self.entropy:
            return token_logps(batch, output_tensor)
        logp, entropy = vocab_parallel_logp_entropy(output_tensor, batch.target.reshape(output_tensor.shape[:-1]))
        return torch.stack([logp.reshape(-1), entropy.reshape(-1)])

    def write(self, rollouts, table: dict) -> None:
        from mindspeed_pack.datasets.rollouts import rollout_file_format

        args = self.args
        path, field = args.score_output, " and ".join(self.fields)
        rows = []
        for i, r in enumerate(rollouts):
            row = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.row.items()}
            row.update(table[i])
            rows.append(row)
        tmp = stale_files.temporary_for(path, "--score-output")
        if rollout_file_format(path) == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            import json

            with open(tmp, "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        os.replace(tmp, path)
        log.info("score: %s of %d rollouts under %s -> %s", field, len(rows), args.load, path)
        print(f" {field} of {len(rows)} rollouts written to {path}", flush=True)
