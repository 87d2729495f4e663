"""Per-token log-probs of rollouts under a checkpoint (``posttrain.py --stage score``).

``posttrain.py --stage score --load CKPT --rollout-path IN.jsonl --score-output OUT.jsonl
--score-field old_logprobs`` runs ``--load`` forward over the rollouts, packed as ``--stage grpo``
packs them (:class:`~mindspeed_pack.data.rollouts.RolloutBatchSource`, any TP/PP/DP layout),
and writes every row back with the log-prob of each response token under ``--score-field``
(``old_logprobs`` for the sampling policy, ``ref_logprobs`` for the reference), rows in input
order. The forward pass is the reference scorer's (:func:`.reference.score_batches`).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch.distributed as dist
from megatron.core import parallel_state as ps

from mindspeed_pack.data.packed_dataset import DataError
from mindspeed_pack.training.stages.reference import ReferenceScoringStage

log = logging.getLogger(__name__)


class ScoreStage(ReferenceScoringStage):
    """``--stage score``: one forward pass over every rollout (the reference scorer's run); no training."""

    name = "score"

    def batch_source(self, args):
        from mindspeed_pack.data.rollouts import RolloutBatchSource

        return RolloutBatchSource(need_advantages=False)

    def check(self, args) -> None:
        from mindspeed_pack.data.rollouts import rollout_file_format

        super().check(args)
        if not args.score_output:
            raise DataError("--stage score needs --score-output (a .jsonl or .parquet file)")
        rollout_file_format(args.score_output)

    def score(self, trainer) -> dict:
        """{rollout index: log-probs of its response tokens} of this rank, gathered and written on one rank."""
        from mindspeed_pack.data.rollouts import rollout_row
        from mindspeed_pack.training.stages.reference import score_batches, token_logps
        from mindspeed_pack.training.trainer import to_packed_batch

        args, source = self.args, trainer.source
        n = len(source.rollouts)
        per_step = args.global_batch_size
        mine = {}
        for start in range(0, n, per_step):
            rows, _ = source.plan(np.arange(start, min(n, start + per_step)))
            raw = [rollout_row([source.rollouts[int(i)] for i in row], source.capacity, every_response_token=True)
                   for row in rows]
            batches = [to_packed_batch(mb, args) for mb in raw]
            # every DP rank runs the same number of rows (empty ones where it has fewer samples)
            for row, mb, logp in zip(rows, raw, score_batches(trainer.model, batches, source.capacity, token_logps)):
                if logp is None:
                    continue
                logp = logp.reshape(-1).cpu()
                for i, first in zip(row, mb["response_starts"]):
                    r = source.rollouts[int(i)]
                    mine[int(i)] = logp[first:first + len(r.response_ids)].tolist()
        writer = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
        if writer:
            gathered = [None] * ps.get_data_parallel_world_size()
            dist.all_gather_object(gathered, mine, group=ps.get_data_parallel_group())
            if ps.get_data_parallel_rank() == 0:
                table = {}
                for part in gathered:
                    table.update(part)
                self.write(source.rollouts, table)
        dist.barrier()
        return mine

    def write(self, rollouts, table: dict) -> None:
        from mindspeed_pack.data.rollouts import rollout_file_format

        args = self.args
        path, field = args.score_output, args.score_field
        rows = []
        for i, r in enumerate(rollouts):
            row = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.row.items()}
            row[field] = table[i]
            rows.append(row)
        tmp = f"{path}.tmp-{os.getpid()}"
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
