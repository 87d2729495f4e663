"""RL loops in one job: the trainer kept alive between rollout rounds (``--stage grpo`` in process).

A generation engine (vLLM, SGLang, a sampler) and the trainer alternate; the trainer's model,
optimizer, scheduler and process groups stay up from round to round::

    session = RLSession.from_argv([...posttrain.py flags, no --rollout-path...])   # every rank
    for k in range(rounds):
        session.export_hf(f"out/hf/round_{k}")    # the current weights, for the engine to reload
        rows = ...                                # engine output: prompt_ids, response_ids, reward, group
        for row, logps in zip(rows, session.score(rows)):
            row["old_logprobs"] = logps           # the sampling policy's log-probs, exact ids
        records = session.step(rows)              # GRPO optimizer steps on these rollouts
        session.save("out/ckpt")                  # a Megatron checkpoint (resume with --load)
    session.close()

Nothing here is a second loop: :meth:`RLSession.step` is the trainer's own iteration
(:meth:`~mindspeed_pack.training.trainer.Trainer.train_iteration`) over a
:class:`~mindspeed_pack.datasets.rollouts.RolloutBatchSource` whose rollouts are handed over
instead of read from ``--rollout-path``, so rows are packed, balanced over DP ranks, lost and
logged exactly as ``posttrain.py --stage grpo`` does with the same rollouts in a file, and
:meth:`RLSession.score` is ``--stage score``'s forward pass. Every rank calls every method
with the same rows (each rank packs its own share).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from typing import List, Optional

import numpy as np
import torch.distributed as dist

from mindspeed_pack.checkpoint import hf_checkpoint
from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.datasets.rollout_text import tokenize_text_rows
from mindspeed_pack.datasets.rollouts import Rollout, RolloutBatchSource, check_rollouts
from mindspeed_pack.runtime import peers
from mindspeed_pack.training.stages.score import ScoreStage

log = logging.getLogger(__name__)


class HandedRollouts(RolloutBatchSource):
    """``--stage grpo``'s batch source over rollouts handed over in memory, round after round.

    A round's global batch ``g`` is its rollouts ``[g*GBS, (g+1)*GBS)``, as in a file of them."""

    def __init__(self, need_advantages: bool = True):
        super().__init__(need_advantages)
        self.first_sample = 0  # the trainer's consumed samples when this round's rollouts came

    def read(self, args):
        return [], {"rollouts": 0, "dropped over-long": 0}

    def hand_over(self, rows: List[dict], consumed_samples: int, need_advantages: bool,
                  where: Optional[List[str]] = None) -> List[Rollout]:
        """Check ``rows`` and make them the data from ``consumed_samples`` on; an error names the row
        by ``where[i]`` ("FILE: line N") if given, else as ``rollout I`` (its index)."""
        args = self.args
        where = where or [f"rollout {i}" for i in range(len(rows))]
        self.rollouts, self.counts = check_rollouts(
            tokenize_text_rows(zip(where, rows), args, "handed rollouts"), args.vocab_size or args.padded_vocab_size,
            self.capacity, args.rollout_overlong, args.advantage_estimator, need_advantages, name="handed rollouts")
        self.first_sample = consumed_samples
        self._plans = {}
        return self.rollouts

    def _step(self, consumed: int):
        return super()._step(consumed - self.first_sample)


class _ScoresInMemory(ScoreStage):
    """``--stage score``'s pass, its table kept instead of written to ``--score-output``."""

    table: Optional[dict] = None

    def write(self, rollouts, table: dict) -> None:
        self.table = table


def session_arg_provider(extra_args_provider=None):
    """posttrain.py's flags for a session (``--stage grpo``, no ``--rollout-path``), plus a script's own."""
    from mindspeed_pack.config.arguments import per_split_data_args
    from mindspeed_pack.training.stages import stage_args

    def provider(p):
        stage_args(per_split_data_args(p))
        if extra_args_provider is not None:
            extra_args_provider(p)
        p.set_defaults(stage="grpo", rollouts_in_process=True)
        return p

    return provider


def session_args(argv=None, extra_args_provider=None):
    """The parsed and checked flags of a session (``--dry-run`` prints them and exits)."""
    from mindspeed_pack.config.arguments import parse_args
    from mindspeed_pack.datasets.packed_dataset import resolve_vocab_size
    from mindspeed_pack.training import run_plan

    args = parse_args(argv, extra_args_provider=session_arg_provider(extra_args_provider),
                      description="mindspeed-pack in-process RL session (GRPO on rollouts handed over)")
    if args.stage != "grpo":
        raise DataError(f"an RL session trains with --stage grpo, not --stage {args.stage}")
    if args.save_hf:
        raise DataError("an RL session writes Hugging Face weights when asked, with export_hf(DIR) (a new directory "
                        "per iteration): drop --save-hf")
    resolve_vocab_size(args)
    if run_plan.dry_run(args, os.path.basename(sys.argv[0])):
        raise SystemExit(0)
    return args


class RLSession:
    """Model, optimizer, scheduler and process groups built once; rollouts scored and trained on in memory."""

    def __init__(self, args):
        from mindspeed_pack.training.stages.grpo import GRPOStage
        from mindspeed_pack.training.trainer import Trainer

        self.args = args
        self.source = HandedRollouts()
        # the driver resumes a session with --load (its rounds of rollouts restart with it), never from --save
        self.trainer = Trainer(args, self.source, GRPOStage(args), resume_save=False)
        self.scorer = _ScoresInMemory(args)
        self.closed = False
        try:
            with self._phase(None):
                self.trainer.setup()
            for chunk in self.trainer.model:
                chunk.train()
        except BaseException:
            self.close(barrier=False)
            raise

    @contextlib.contextmanager
    def _phase(self, what: Optional[str]):
        """A dead or hung peer during the block is a PeerFailure naming what this rank was doing."""
        if what:
            self.trainer.phase = what
        with peers.waiting_for(lambda: self.trainer.phase, self.args.distributed_timeout_minutes):
            yield
        self.trainer.phase = "the caller's work between rollout rounds"

    @classmethod
    def from_argv(cls, argv=None, extra_args_provider=None) -> "RLSession":
        return cls(session_args(argv, extra_args_provider))

    @property
    def iteration(self) -> int:
        return self.trainer.iteration

    def score(self, rows: List[dict], where: Optional[List[str]] = None) -> List[Optional[np.ndarray]]:
        """Log-prob of every response token of every row under the current weights (eval mode), in
        row order, on every rank: what ``--stage score`` writes as ``old_logprobs``/``ref_logprobs``
        (None for a row dropped as over-long under ``--rollout-overlong drop``). ``where``: each
        row's name in error messages (default ``rollout I``)."""
        trainer = self.trainer
        where = where or [f"rollout {i}" for i in range(len(rows))]
        kept = self.source.hand_over(rows, trainer.consumed_samples, need_advantages=False, where=where)
        with self._phase(f"scoring {len(rows)} rollouts at iteration {trainer.iteration}"):
            for chunk in trainer.model:
                chunk.eval()
            try:
                self.scorer.table = None
                self.scorer.score(trainer)
            finally:
                for chunk in trainer.model:
                    chunk.train()
            # the writer (last pipeline stage, first TP and DP rank) holds the whole table: share it
            tables = [None] * dist.get_world_size()
            dist.all_gather_object(tables, self.scorer.table)
        table = next(t for t in tables if t is not None)
        out: List[Optional[np.ndarray]] = [None] * len(rows)
        row_of = {name: i for i, name in enumerate(where)}
        for k, rollout in enumerate(kept):
            out[row_of[rollout.where]] = np.asarray(table[k][self.scorer.fields[0]], dtype=np.float64)
        return out

    def step(self, rows: List[dict], steps: Optional[int] = None, where: Optional[List[str]] = None) -> List[dict]:
        """GRPO optimizer steps on ``rows`` (``steps`` global batches of them, cycling; default
        ceil(rows / GBS): each row once, the first ones twice where GBS does not divide the rows: said),
        packed and reduced as ``--stage grpo`` does; returns each
        step's logged record. ``where``: each row's name in error messages (default ``rollout I``)."""
        trainer, args = self.trainer, self.args
        kept = self.source.hand_over(rows, trainer.consumed_samples, need_advantages=True, where=where)
        trainer.stage.setup(trainer)  # its checks of the rollouts (ref_logprobs under --kl-coef)
        if steps is None:
            steps = math.ceil(len(kept) / args.global_batch_size)
            again = steps * args.global_batch_size - len(kept)  # the last global batch fills up from the start
            if again:
                log.warning("%d rollouts are not a multiple of --global-batch-size %d: the last of %d steps fills up "
                            "with the first ones again, so %d of them (%s to %s) are trained twice this round",
                            len(kept), args.global_batch_size, steps, again, kept[0].where, kept[again - 1].where)
        with self._phase(None):  # the trainer names each iteration
            return [trainer.train_iteration() for _ in range(steps)]

    def save(self, directory: Optional[str] = None) -> None:
        """A Megatron checkpoint of the current iteration in ``directory`` (default ``--save``)."""
        if directory:
            self.args.save = directory
        if not self.args.save:
            raise DataError("RLSession.save: give a directory (or --save)")
        with self._phase(f"the save of iteration {self.trainer.iteration}"):
            self.trainer.save()

    def export_hf(self, directory: str) -> None:
        """The current weights as a Hugging Face model directory (new or empty): what a generation
        engine reloads. Complete or absent, as ``--save-hf``."""
        hf_checkpoint.check_exportable(self.args)
        # named by the call, not by --save-hf/--save-dir (flags a session does not take), and before the merge;
        # rank 0's view (the one that writes it), so that every rank stops or none
        taken = [dist.get_rank() == 0 and os.path.exists(directory)
                 and (not os.path.isdir(directory) or bool(os.listdir(directory)))]
        dist.broadcast_object_list(taken, src=0)
        if taken[0]:
            raise DataError(f"export_hf({directory!r}): it exists and is not an empty directory; export each iteration "
                            "to a new one (docs/rl.md); nothing was written there")
        with self._phase(f"the Hugging Face export of iteration {self.trainer.iteration}"):
            self.trainer.sync_params()
            hf_checkpoint.save_hf(self.args, self.trainer.model, out_dir=directory)

    def close(self, barrier: bool = True) -> None:
        """Close the logs (and wait for every rank after a normal end)."""
        if self.closed:
            return
        self.closed = True
        with self._phase("the other ranks to finish (final barrier)"):
            self.trainer.cleanup(barrier=barrier)

    def __enter__(self) -> "RLSession":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(barrier=exc_type is None)
