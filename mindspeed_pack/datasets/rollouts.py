"""RL rollouts: read, checked, and laid out in packed rows (``--stage score`` / ``--stage grpo``).

A rollout file (``.jsonl``, ``.json``, ``.parquet``; one row per sample) holds the exact sampled
ids, never re-tokenised::

    prompt_ids      [int]      the prompt as the generator saw it
    response_ids    [int]      the sampled response
    response_mask   [0/1]      optional: 0 for response tokens that are not actions (tool output)
    old_logprobs    [float]    optional: log-probs of the response under the sampling policy
    ref_logprobs    [float]    optional: log-probs under the reference (for --kl-coef)
    advantages      [float]    per response token, or
    reward, group   float, any scalar reward; advantages normalised within the group
                               (--advantage-estimator grpo: (r - mean) / (std + 1e-6); rloo: r - mean of the others)

A row may give text instead of ids (``prompt`` or OpenAI ``messages``, and ``response``): it is
tokenised through the template path of ``--prompt-type`` (:mod:`mindspeed_pack.datasets.rollout_text`)
and keeps a record of it; exact ids stay the recommended form.

Each row is checked on load (lengths agree with ``response_ids``, ids fit the vocabulary); a bad
row stops the run with a :class:`DataError` naming the file and line/row and the field. A sample
longer than a row (``--max-seqlen-per-dp-cp-rank`` x CP) is refused (``--rollout-overlong refuse``) or dropped
and counted (``drop``), never truncated.

One sample is one segment of a row. Token ``P + j`` (response token ``j``, ``P`` prompt tokens)
is predicted at position ``P + j - 1``, so the per-token fields of response token ``j`` are stored
there, where the shifted target and the model's per-token loss of that token sit::

    position       0   1   2   3   4   5
    input_ids      p0  p1  p2  r0  r1  r2        (P = 3)
    labels         -   -   -   r0  r1  r2        (stored unshifted, as every pack)
    advantages     0   0   a0  a1  a2  0         (a_j at P + j - 1; the last position predicts nothing)
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from mindspeed_pack.data.errors import PreprocessError
from mindspeed_pack.data.readers import FORMATS, chunk_rows, iter_chunks
from mindspeed_pack.datasets.packed_dataset import DataError
from mindspeed_pack.packing.context_parallel import padding_multiple, round_up
from mindspeed_pack.packing.segments import IGNORE_INDEX

log = logging.getLogger(__name__)

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages")  # float per response token
ESTIMATORS = ("grpo", "rloo")


@dataclass
class Rollout:
    prompt_ids: np.ndarray  # int64 [P]
    response_ids: np.ndarray  # int64 [R]
    response_mask: np.ndarray  # bool [R]
    where: str  # "FILE: line N" for error messages and the written-back file
    row: dict  # the row as read (written back with new fields by --stage score)
    old_logprobs: Optional[np.ndarray] = None  # float64 [R]
    ref_logprobs: Optional[np.ndarray] = None
    advantages: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


def _ids(row: dict, field: str, where: str, vocab_size: int) -> np.ndarray:
    value = row.get(field)
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        raise DataError(f"{where}: field {field!r} must be a non-empty list of token ids, got {_show(value)}")
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
        raise DataError(f"{where}: field {field!r} must hold integer token ids (the exact sampled ids; a text "
                        "rollout gives 'prompt' or 'messages' and 'response' instead)")
    try:
        ids = np.asarray(value, dtype=np.int64)
    except OverflowError:  # beyond int64 (JSON integers have no limit): found among the Python ints below
        ids = None
    if ids is None:
        bad = next(i for i, x in enumerate(value) if not 0 <= int(x) < vocab_size)
    else:
        bad = next(iter(np.flatnonzero((ids < 0) | (ids >= vocab_size))), None)
    if bad is not None:
        raise DataError(f"{where}: field {field!r}[{int(bad)}] = {int(value[bad])} does not fit the vocabulary "
                        f"of {vocab_size} tokens")
    return ids


def _per_token(row: dict, field: str, where: str, length: int) -> Optional[np.ndarray]:
    value = row.get(field)
    if value is None:
        return None
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise DataError(f"{where}: field {field!r} must be a list (one value per response token), got {_show(value)}")
    if len(value) != length:
        raise DataError(f"{where}: field {field!r} has {len(value)} values but response_ids has {length} tokens")
    try:
        out = np.asarray(value)
    except ValueError:  # ragged nesting
        out = np.empty((0, 0))
    if out.ndim != 1:  # nested lists pass the length check, then fail to broadcast mid-step
        raise DataError(f"{where}: field {field!r} must be a flat list of numbers (one per response token), got "
                        f"{_show(value)}")
    if out.dtype.kind not in "biuf":  # strings (which numpy would parse), null, objects; or ints beyond int64
        if not all(isinstance(x, (int, float, np.number)) for x in value):
            raise DataError(f"{where}: field {field!r} must hold numbers, got {_show(value)}")
        out = np.array([float(x) if abs(x) < 1e308 else math.inf for x in value])  # beyond any float: not finite
    out = out.astype(np.float64)
    if not np.all(np.isfinite(out)):
        raise DataError(f"{where}: field {field!r}[{int(np.flatnonzero(~np.isfinite(out))[0])}] is not finite")
    return out


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict, str, int, float, type(None))) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_rollout(row, where: str, vocab_size: int) -> Rollout:
    """One checked row (its advantages may still come from ``reward`` and ``group``)."""
    if isinstance(row, Exception):
        raise DataError(str(row)) from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a rollout row must be an object, got {type(row).__name__}")
    prompt = _ids(row, "prompt_ids", where, vocab_size)
    response = _ids(row, "response_ids", where, vocab_size)
    mask = _per_token(row, "response_mask", where, len(response))
    if mask is not None and not np.all((mask == 0) | (mask == 1)):
        raise DataError(f"{where}: field 'response_mask' must hold 0 or 1")
    out = Rollout(prompt, response, np.ones(len(response), bool) if mask is None else mask.astype(bool), where, row)
    for field in TOKEN_FIELDS:
        setattr(out, field, _per_token(row, field, where, len(response)))
    if out.advantages is None and row.get("reward") is not None:
        reward = row["reward"]
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not abs(reward) < 1e308:
            raise DataError(f"{where}: field 'reward' must be a finite number, got {_show(reward)}")
        if row.get("group") is None:
            raise DataError(f"{where}: field 'reward' needs a 'group' (the prompt's id) for group-normalised "
                            "advantages; or give per-token 'advantages'")
    return out


def group_advantages(rewards: np.ndarray, groups: list, estimator: str, where: list) -> np.ndarray:
    """Scalar advantage of every sample from its reward and its group's (GRPO or RLOO)."""
    out = np.zeros(len(rewards))
    members: dict = {}
    for i, g in enumerate(groups):
        members.setdefault(json.dumps(g, sort_keys=True), []).append(i)
    for idx in members.values():
        r = rewards[idx]
        if estimator == "grpo":
            std = r.std(ddof=1) if len(r) > 1 else 0.0
            out[idx] = (r - r.mean()) / (std + 1e-6)
        else:
            if len(r) < 2:
                raise DataError(f"{where[idx[0]]}: group {groups[idx[0]]!r} has one sample: leave-one-out (rloo) "
                                "needs at least two per group")
            out[idx] = r - (r.sum() - r) / (len(r) - 1)
    singles = [idx[0] for idx in members.values() if len(idx) == 1]
    if singles and estimator == "grpo":  # rloo refuses them above; grpo's (r - mean) / (std + 1e-6) is 0 there
        log.warning("%d of %d groups have one sample (the first: %s, group %r): their advantage is 0 under "
                    "--advantage-estimator grpo, so they train nothing (give all samples of a prompt one 'group')",
                    len(singles), len(members), where[singles[0]], groups[singles[0]])
    return out


def check_rollouts(rows, vocab_size: int, max_length: int, overlong: str = "refuse", estimator: str = "grpo",
                   need_advantages: bool = True, name: str = "rollouts") -> tuple[List[Rollout], dict]:
    """Checked rollouts of ``rows`` ((where, row) pairs: a file's lines, or rows handed over in
    memory) and counts {'rollouts', 'dropped over-long'}; advantages from reward and group."""
    rollouts = []
    dropped = 0
    for where, row in rows:
        r = parse_rollout(row, where, vocab_size)
        if len(r) > max_length:
            if overlong == "drop":
                dropped += 1
                continue
            raise DataError(f"{where}: {len(r.prompt_ids)} prompt + {len(r.response_ids)} response tokens "
                            f"= {len(r)} > {max_length}, the tokens of a row (--max-seqlen-per-dp-cp-rank x "
                            "--context-parallel-size; rollouts are never truncated: raise it, or "
                            "--rollout-overlong drop to drop and count such samples)")
        rollouts.append(r)
    if not rollouts:
        raise DataError(f"{name}: no rollouts" + (f" ({dropped} dropped as over-long)" if dropped else ""))
    if need_advantages:
        missing = [r for r in rollouts if r.advantages is None and r.row.get("reward") is None]
        if missing:
            raise DataError(f"{missing[0].where}: neither 'advantages' (per response token) nor 'reward' with "
                            "'group': the policy step needs one of them")
        scalar = [r for r in rollouts if r.advantages is None]
        if scalar:
            adv = group_advantages(np.array([float(r.row["reward"]) for r in scalar]), [r.row["group"] for r in scalar],
                                   estimator, [r.where for r in scalar])
            for r, a in zip(scalar, adv):
                r.advantages = np.full(len(r.response_ids), a)
    if dropped:
        log.warning("%s: %d over-long rollouts dropped (> --max-seqlen-per-dp-cp-rank %d tokens)", name, dropped,
                    max_length)
    return rollouts, {"rollouts": len(rollouts), "dropped over-long": dropped}


def load_rollouts(path: str, vocab_size: int, max_length: int, overlong: str = "refuse",
                  estimator: str = "grpo", need_advantages: bool = True, text_args=None) -> tuple[List[Rollout], dict]:
    """Checked rollouts of ``path`` (file or directory): :func:`check_rollouts` over its rows; with
    ``text_args`` (the run's flags) text rows are tokenised (:mod:`mindspeed_pack.datasets.rollout_text`)."""
    from mindspeed_pack.data.readers import resolve_input_files
    from mindspeed_pack.datasets.rollout_text import tokenize_text_rows

    def rows():
        for chunk in iter_chunks(resolve_input_files(path, "--rollout-path"), 4096):
            yield from chunk_rows(chunk) if text_args is None else tokenize_text_rows(chunk_rows(chunk), text_args, path)

    try:
        return check_rollouts(rows(), vocab_size, max_length, overlong, estimator, need_advantages, name=path)
    except PreprocessError as exc:  # unreadable files, malformed JSON lines
        raise DataError(str(exc)) from None


def rollout_row(rollouts: List[Rollout], capacity: int, every_response_token: bool = False,
                multiple: int = 1) -> dict:
    """One packed row of ``capacity`` tokens (a micro-batch ``[1, capacity]``), one sample per segment.

    Besides the pack arrays the trainer reads (``input_ids``, ``labels``, ``segment_ids``) it
    holds the per-token fields at the position that predicts each response token (float
    ``[1, capacity]``; zero where a field is absent or nothing is trained) and ``response_starts``
    (each sample's first such position) for writing scores back. ``every_response_token`` trains
    (scores) every response token, ``response_mask`` ignored. Under context parallelism each
    sample's segment spans its length rounded up to ``multiple`` (the CP split's; the pads end
    the segment, untrained, and are marked in ``pad_mask``: a mixture of experts routes them nowhere), so the CP
    view splits the row as laid out here."""
    ids = np.zeros(capacity, np.int64)
    labels = np.full(capacity, IGNORE_INDEX, np.int64)
    seg = np.zeros(capacity, np.int64)
    pad = np.zeros(capacity, bool)
    fields = {f: np.zeros(capacity) for f in TOKEN_FIELDS}
    # a field is laid out only if every rollout of the row has it: --stage grpo refuses files whose
    # old_logprobs are in some rollouts only, so no rollout's ratio depends on its pack-mates
    present = {f: all(getattr(r, f) is not None for r in rollouts) for f in TOKEN_FIELDS}
    starts, pos = [], 0
    for k, r in enumerate(rollouts, start=1):
        p, n = len(r.prompt_ids), len(r)
        span = round_up(n, multiple)
        if pos + span > capacity:
            raise ValueError(f"rollouts of {pos + span} tokens do not fit a row of {capacity}")
        ids[pos:pos + p], ids[pos + p:pos + n] = r.prompt_ids, r.response_ids
        trained = np.ones(len(r.response_ids), bool) if every_response_token else r.response_mask
        labels[pos + p:pos + n] = np.where(trained, r.response_ids, IGNORE_INDEX)
        seg[pos:pos + span] = k
        pad[pos + n:pos + span] = True
        for f in TOKEN_FIELDS:
            if present[f]:
                fields[f][pos + p - 1:pos + n - 1] = getattr(r, f)
        starts.append(pos + p - 1)
        pos += span
    out = {"input_ids": torch.from_numpy(ids[None]), "labels": torch.from_numpy(labels[None]),
           "segment_ids": torch.from_numpy(seg[None]), "sample_ids": None,
           "segment_lengths": np.array([len(r) for r in rollouts], np.int64), "response_starts": starts,
           "pad_mask": torch.from_numpy(pad[None])}
    for f in TOKEN_FIELDS:
        out[f] = torch.from_numpy(fields[f][None]) if present[f] else None
    return out


def dynamic_cp_preview(args, steps: int = 2) -> List[str]:
    """``--dry-run`` of ``--stage grpo|score`` under ``default_dynamic_cp``: the first steps' plans from the rollouts'
    lengths (read and checked as the run reads them; nothing is written). A rollout is named by its place among the
    kept rollouts (file order; after those dropped as over-long under ``--rollout-overlong drop``)."""
    from mindspeed_pack.datasets.online_packing import preview_lines

    rollouts, counts = load_rollouts(args.rollout_path, args.vocab_size or args.padded_vocab_size,
                                     args.max_seqlen_per_dp_cp_rank * args.context_parallel_size,
                                     args.rollout_overlong, args.advantage_estimator, need_advantages=False,
                                     text_args=args)
    lengths = np.array([len(r) for r in rollouts], np.int64)
    n, gbs = len(rollouts), args.global_batch_size
    batches = []
    for step in range(steps):  # grpo cycles through the file; score reads it once
        index = np.arange(step * gbs, (step + 1) * gbs)
        index = index % n if args.stage == "grpo" else index[index < n]
        if len(index):
            batches.append((index, lengths[index], 0))
    dropped = f" ({counts['dropped over-long']} dropped as over-long)" if counts["dropped over-long"] else ""
    return preview_lines(args, batches, f"rollouts named by their place in {args.rollout_path}{dropped}")


def rollout_file_format(path: str) -> str:
    """'jsonl' or 'parquet': how ``--stage score`` writes ``path`` (from its extension)."""
    from pathlib import Path

    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt not in ("jsonl", "parquet"):
        raise DataError(f"{path}: scored rollouts are written as .jsonl or .parquet")
    return fmt


@dataclass
class PlannedRow:
    """One micro-batch of a rank: its rollouts (indices, in row order) and, under dynamic context parallelism,
    the CP group the row runs on (``cp_size`` ranks, this rank its ``cp_rank``; None: the job's fixed CP split)."""

    rollouts: np.ndarray
    cp_size: Optional[int] = None
    cp_rank: int = 0


class RolloutBatchSource:
    """The trainer's data under ``--stage grpo`` (and the rows of ``--stage score``).

    Global batch ``g`` is rollouts ``[g*GBS, (g+1)*GBS)`` of the file (in file order, cycling).
    Every rank derives the same plan from the samples' lengths: spread over DP ranks by
    attention cost, each share packed with the C++ best-fit-decreasing packer into rows of
    ``--max-seqlen-per-dp-cp-rank`` x CP tokens (a hard cap; under CP at the samples' CP-padded
    lengths, so each CP rank holds at most the cap), the same number of rows on every rank
    (:func:`mindspeed_pack.packing.balance.plan_online_packing`). A micro-batch is one row.

    Under ``--sequence-packing-scheduler default_dynamic_cp`` a rollout is a unit of one sequence, planned as
    every sample is (:mod:`mindspeed_pack.packing.dynamic_cp`): on the smallest CP group of the data x context
    parallel ranks that holds it, a row of ``g x N`` tokens laid out for that group's zigzag split (an empty row
    of ``N`` where a rank has no job). Rollouts of one prompt need not share a row: their advantages are taken
    from the group's rewards when the file is read."""

    docs: list = []  # no packed prefixes (the trainer's sidecar checks read those)
    dynamic_cp = False  # the trainer sums the step's counts over the data x context parallel pool when True

    def __init__(self, need_advantages: bool = True):
        self.need_advantages = need_advantages

    def setup(self, args, num_samples: dict) -> None:
        from megatron.core import parallel_state as ps

        from mindspeed_pack.packing.balance import cost_model

        if args.micro_batch_size != 1:
            raise DataError("rollout stages: a micro-batch is one packed row of --max-seqlen-per-dp-cp-rank tokens; "
                            "use --micro-batch-size 1")
        # under context parallelism a row is split over the CP group (each rank holds
        # --max-seqlen-per-dp-cp-rank tokens of it); samples are planned and laid out at their CP-padded length
        cp = args.context_parallel_size
        self.multiple = padding_multiple(cp, args.tensor_model_parallel_size, args.sequence_parallel) if cp > 1 else 1
        self.capacity = args.max_seqlen_per_dp_cp_rank * cp  # the longest rollout (under dynamic CP too)
        if self.capacity % self.multiple:
            raise DataError(f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} x --context-parallel-size "
                            f"{cp} must be a multiple of {self.multiple} (every sample is padded to it for the CP "
                            "split)")
        self.args = args
        self.rollouts, self.counts = self.read(args)
        self.cost = cost_model(args)
        self.dynamic_cp = args.sequence_packing_scheduler == "default_dynamic_cp"
        if self.dynamic_cp:
            from mindspeed_pack.runtime.process_groups import check_dynamic_cp_groups

            self.pool_rank = ps.get_data_parallel_rank(with_context_parallel=True)
            self.pool_size = ps.get_data_parallel_world_size(with_context_parallel=True)
            check_dynamic_cp_groups(cp)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self._plans: dict = {}

    def read(self, args) -> tuple[List[Rollout], dict]:
        """The checked rollouts of ``--rollout-path`` and their counts."""
        return load_rollouts(args.rollout_path, args.vocab_size or args.padded_vocab_size, self.capacity,
                             args.rollout_overlong, args.advantage_estimator, self.need_advantages, text_args=args)

    def has_split(self, split: str) -> bool:
        return split == "train"

    def plan(self, indices: np.ndarray) -> tuple[List[PlannedRow], dict]:
        """(this rank's rows, the step's plan statistics) for the given rollouts."""
        from mindspeed_pack.packing.balance import imbalance, plan_online_packing

        indices = np.asarray(indices, np.int64)
        lengths = np.array([len(self.rollouts[i]) for i in indices], np.int64)
        if self.dynamic_cp:
            from mindspeed_pack.datasets.online_packing import step_plan

            plan = step_plan(lengths, self.args, self.pool_size, self.cost)
            rows = [PlannedRow(indices[:0], 1, 0) if job is None
                    else PlannedRow(indices[job.samples], job.size, self.pool_rank - job.first_rank)
                    for job in plan.rank_jobs(self.pool_rank)]
            return rows, plan.stats(lengths)
        ranks = plan_online_packing(round_up(lengths, self.multiple), self.dp_size, self.capacity, self.cost)
        return [PlannedRow(indices[row]) for row in ranks[self.dp_rank].rows], \
            {"rank imbalance": imbalance([r.cost for r in ranks])}

    def _step(self, consumed: int):
        if consumed not in self._plans:
            n = len(self.rollouts)
            indices = np.arange(consumed, consumed + self.args.global_batch_size) % n
            self._plans = {consumed: self.plan(indices)}
        return self._plans[consumed]

    @property
    def max_tokens_per_cp_rank(self) -> int:
        """Megatron-LM's cap on a micro-batch's tokens per CP rank, checked by the trainer."""
        return self.args.max_seqlen_per_dp_cp_rank

    def row(self, planned: PlannedRow, every_response_token: bool) -> dict:
        """The packed row of ``planned`` rollouts, laid out for the CP split it runs under: the job's fixed one,
        or (dynamic CP) its own group's, with ``cp_size`` and ``cp_rank`` for the trainer's view of it."""
        rollouts = [self.rollouts[int(i)] for i in planned.rollouts]
        if planned.cp_size is None:
            return rollout_row(rollouts, self.capacity, every_response_token, self.multiple)
        args, g = self.args, planned.cp_size
        multiple = padding_multiple(g, args.tensor_model_parallel_size, args.sequence_parallel) if g > 1 else 1
        # an empty row (no job for this rank in this slot) is N tokens on this rank alone
        out = rollout_row(rollouts, g * args.max_seqlen_per_dp_cp_rank, every_response_token, multiple)
        out.update(cp_size=g, cp_rank=planned.cp_rank)
        return out

    def step_shape(self, split: str, consumed: int):
        """(micro-batches, tokens per micro-batch as megatron counts them: N x --context-parallel-size, which its
        pipeline divides by the CP size, the plan's statistics)."""
        rows, stats = self._step(consumed)
        return len(rows), self.capacity, stats

    def micro_batches(self, split: str, consumed: int):
        rows, _ = self._step(consumed)
        for planned in rows:
            mb = self.row(planned, every_response_token=not self.need_advantages)
            mb["rollouts"] = [int(i) for i in planned.rollouts]
            yield mb
