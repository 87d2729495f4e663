"""``--sequence-packing-scheduler dp_balanced``: pack at load time and balance DP ranks by cost.

Global batch ``g`` is still samples ``[g*GBS, (g+1)*GBS)`` of the split's sample index (same
seed, ``--no-shuffle``, ``--padded-samples``, ``consumed_samples``), so resuming stays exact;
only *how* those samples are laid out over ranks and rows changes. Every rank derives the same
plan from the samples' lengths (document sizes from the ``.idx``: no token reads, no
communication), see :mod:`mindspeed_pack.packing.balance`.

* Unpacked data (``preprocess_data.py`` without ``--pack``: one sample per document): the
  batch's samples are spread over DP ranks by estimated cost, each rank's share is packed
  with the C++ best-fit-decreasing packer into rows of ``--max-seqlen-per-dp-cp-rank`` tokens
  (``C``, default ``--seq-length``), and every rank runs the same number of rows. A micro-batch
  is one row of ``C`` tokens (fixed shape for pipelines), samples isolated as segments::

      rank 0:  row 0 = [s3 s3 s3 s3 s0 s0 s7 . ]   row 1 = [s5 s5 s5 s5 s5 s1 s1 . ]
      rank 1:  row 0 = [s2 s2 s2 s2 s2 s2 s2 s2]   row 1 = [s4 s4 s6 s6 s6 . . . ]

  Samples longer than ``C`` are truncated to ``C`` (a warning at start counts them).
  A document of preference pairs or KTO couples is one *unit* (chosen + rejected, sample + KL
  partner: segments 1 and 2, as under ``default_dynamic_cp``): balanced and packed as one item,
  whole in one row; a unit longer than a row is refused by name, never truncated.
  Under ``--context-parallel-size N`` a row holds ``N x C`` tokens (each CP rank keeps ``C``):
  samples (a unit's sequences each on its own) are planned *and laid out* at their length padded
  to ``2N`` (the pads end the sample, untrained, as ``--pad-to-multiple-of`` pads do; see
  :mod:`mindspeed_pack.packing.context_parallel`), so the CP view adds nothing and every CP rank
  holds exactly ``C`` tokens (Megatron-LM's cap). Changing ``C`` needs no new preprocessing.
* Offline packs (``--pack``): each global batch's packs are assigned to ranks, ``GBS/DP``
  each, balancing the packs' costs (from the samples :func:`micro_batch` finds in them, the
  recorded or EOS boundaries of plain packs included); the micro-batch count is unchanged.

Every micro-batch names its documents (``documents``), for the per-document data beside them
(KTO labels, precomputed reference log-probs).

Micro-batches come from :func:`~mindspeed_pack.datasets.packed_dataset.micro_batch`, as under
scheduler ``none``, so both schedulers isolate, position and count samples alike.

The loss is the per-token mean over the global batch, so neither layout changes it.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterator, List, Optional

import numpy as np
import torch

from mindspeed_pack.datasets.packed_dataset import DataError, PackedBatchSource, SplitDataset, micro_batch
from mindspeed_pack.packing.balance import balance_partition, cost_model, imbalance, plan_online_packing
from mindspeed_pack.packing.context_parallel import padding_multiple, round_up
from mindspeed_pack.packing.dynamic_cp import (DynamicCPPlan, group_size_options, plan_dynamic_cp,
                                                planned_lengths, unit_costs, unit_totals)
from mindspeed_pack.packing.segments import IGNORE_INDEX
from mindspeed_pack.runtime.process_groups import check_dynamic_cp_groups

log = logging.getLogger(__name__)

SCHEDULERS = ("none", "dp_balanced", "default_dynamic_cp")


def data_kind(docs) -> str:
    """'packed' or 'unpacked', from the sidecar's layout, else from the documents themselves."""
    kind = ((docs.meta or {}).get("layout") or {}).get("kind")
    if kind in ("packed", "unpacked"):
        return kind
    sizes = docs.datasets["input_ids"].sequence_lengths
    masks = docs.datasets["attention_mask"]
    ones = all(np.all(np.asarray(masks[i]) == 1) for i in range(min(len(docs), 16)))
    return "unpacked" if ones and len(np.unique(sizes)) > 1 else "packed"


class BalancedBatchSource(PackedBatchSource):
    """posttrain's data under ``--sequence-packing-scheduler dp_balanced``."""

    _CACHE = 4  # plans kept (a step asks for its plan twice: shape, then micro-batches)

    def setup(self, args, num_samples: dict) -> None:
        super().setup(args, num_samples)
        docs = next(d.docs for d in self.splits.values() if d is not None)
        self.online = data_kind(docs) == "unpacked"
        self.cost = cost_model(args)
        # document sizes per prefix (--train/--valid-data-path may name different ones); a unit's, per sequence
        self._sizes = {id(d.docs): unit_lengths(d.docs) for d in self.splits.values() if d is not None}
        # under context parallelism a row is split over the CP group: each rank holds exactly
        # --max-seqlen-per-dp-cp-rank tokens of it, samples planned and laid out at their CP-padded length
        cp = args.context_parallel_size
        self.cp_multiple = padding_multiple(cp, args.tensor_model_parallel_size, args.sequence_parallel) if cp > 1 else 1
        self.capacity = args.max_seqlen_per_dp_cp_rank * cp if self.online else args.seq_length
        self._plans: OrderedDict = OrderedDict()
        self._pack_lengths: dict = {}  # offline pack -> its sample lengths
        if self.online:
            self._check_online(args, docs)
            if not args.no_reset_position_ids:  # online rows isolate their samples: positions restart per
                args.reset_position_ids = True  # sample (offline packs keep the flags' meaning, as under none)
        elif args.max_seqlen_per_dp_cp_rank != args.seq_length:
            raise DataError(f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank}: {docs.prefix!r} holds "
                            f"offline packs of --seq-length {args.seq_length} tokens, which dp_balanced only assigns "
                            "to ranks; to pack at load time to another length, preprocess without --pack")
        log.info("dp_balanced: %s", f"online packing into rows of {self.capacity} tokens" if self.online
                 else "offline packs assigned to data-parallel ranks by cost")

    def _check_online(self, args, docs) -> None:
        if args.micro_batch_size != 1:
            raise DataError(f"--sequence-packing-scheduler dp_balanced on unpacked data {docs.prefix!r}: a "
                            "micro-batch is one packed row of --max-seqlen-per-dp-cp-rank tokens; use "
                            "--micro-batch-size 1 (and raise --max-seqlen-per-dp-cp-rank for bigger ones)")
        tp = args.tensor_model_parallel_size
        if self.capacity % self.cp_multiple:
            raise DataError(f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} x --context-parallel-size "
                            f"{args.context_parallel_size} must be a multiple of {self.cp_multiple} (every sample is "
                            "padded to 2 x CP, x TP under --sequence-parallel)")
        if args.sequence_parallel and self.capacity % tp:
            raise DataError(f"--max-seqlen-per-dp-cp-rank {self.capacity} must be a multiple of "
                            f"--tensor-model-parallel-size {tp} under --sequence-parallel")
        for name, split in self.splits.items():
            if split is None:
                continue
            lengths = self._sizes[id(split.docs)][split.start:split.end]
            if lengths.ndim > 1:  # a unit is never truncated: refused by name
                check_overlong(lengths, split.start, args, f"{split.docs.prefix!r} ({name} split)")
                continue
            too_long = int((lengths > self.capacity).sum())
            if too_long:
                log.warning("%d of the %d %s documents of %r are longer than --max-seqlen-per-dp-cp-rank %d "
                            "and will be truncated to it", too_long, split.end - split.start, name, docs.prefix,
                            self.capacity)

    # ---------------------------------------------------------------- plans
    def _plan(self, split: str, consumed: int):
        """The plan of the global batch at ``consumed`` samples, made once (every rank makes the same one from the
        sample lengths) and kept for the step's micro-batches."""
        key = (split, consumed)
        if key in self._plans:
            return self._plans[key]
        dataset = self.splits.get(split)
        if dataset is None:
            raise DataError(f"the {split} split is empty: check --split {self.args.split}")
        gbs = self.args.global_batch_size
        if consumed + gbs > len(dataset):
            raise RuntimeError(f"{split} data exhausted at consumed samples {consumed}: the sample index "
                               "is shorter than train-iters x global-batch-size")
        docs = dataset.start + np.asarray(dataset.index[consumed:consumed + gbs], dtype=np.int64)
        plan = self._make_plan(dataset, docs)
        self._plans[key] = plan
        while len(self._plans) > self._CACHE:
            self._plans.popitem(last=False)
        return plan

    def _make_plan(self, dataset: SplitDataset, docs: np.ndarray) -> dict:
        """This rank's share of the step's documents ``docs``: rows packed online, or whole packs balanced."""
        if self.online:
            lengths = np.minimum(self._sizes[id(dataset.docs)][docs], self.capacity)  # (units are checked at setup)
            padded = round_up(lengths, self.cp_multiple)  # every sequence padded on its own for CP
            ranks = plan_online_packing(unit_totals(padded), self.dp_size, self.capacity, self.cost,
                                        costs=unit_costs(self.cost, padded))
            return {"docs": docs, "rows": ranks[self.dp_rank].rows, "imbalance": imbalance([r.cost for r in ranks])}
        costs = np.array([self.cost.sample_costs(self._pack_segments(dataset, int(d))).sum() for d in docs])
        parts = balance_partition(costs, self.dp_size, equal_counts=True)
        return {"docs": docs[parts[self.dp_rank]], "imbalance": imbalance([costs[p].sum() for p in parts])}

    def _pack_segments(self, dataset: SplitDataset, doc: int) -> np.ndarray:
        """Real sample lengths of an offline pack, as its micro-batch finds them (the whole pack
        if samples are not isolated)."""
        if doc not in self._pack_lengths:
            self._pack_lengths[doc] = micro_batch([dataset.docs.get(doc)], self.args)["segment_lengths"]
        return self._pack_lengths[doc]

    # ---------------------------------------------------------------- the trainer's interface
    def step_shape(self, split: str, consumed: int):
        """(micro-batches this step, tokens per micro-batch, extra step statistics)."""
        plan = self._plan(split, consumed)
        if self.online:
            return len(plan["rows"]), self.capacity, {"rank imbalance": plan["imbalance"]}
        return self.args.num_micro_batches, self.args.seq_length * self.args.micro_batch_size, \
            {"rank imbalance": plan["imbalance"]}

    @property
    def max_tokens_per_cp_rank(self):
        """Megatron-LM's cap on a micro-batch's tokens per CP rank (online rows only), checked by the trainer."""
        return self.args.max_seqlen_per_dp_cp_rank if self.online else None

    def micro_batches(self, split: str, consumed: int) -> Iterator[dict]:
        plan = self._plan(split, consumed)
        docs = self.splits[split].docs
        if self.online:
            for row in plan["rows"]:
                yield self._unit_row(docs, plan["docs"][row])
            return
        mbs = self.args.micro_batch_size
        mine = [int(d) for d in plan["docs"]]
        for i in range(0, len(mine), mbs):
            batch = micro_batch([docs.get(d) for d in mine[i:i + mbs]], self.args)
            batch["documents"] = mine[i:i + mbs]  # which packs (per-pack data beside them: labels, reference)
            yield batch

    def _unit_row(self, docs, documents, capacity: Optional[int] = None, multiple: Optional[int] = None) -> dict:
        """One row of ``documents`` (:meth:`_pack_row`) naming them in segment order, one unit each
        (``document_segments``), for the per-document data beside them (KTO labels, reference log-probs)."""
        documents = [int(d) for d in documents]
        row = self._pack_row([docs.get(d) for d in documents], capacity, multiple)
        row.update(documents=documents, document_segments=[units_per_document(docs)] * len(documents))
        return row

    def _pack_row(self, samples: List[dict], capacity: Optional[int] = None, multiple: Optional[int] = None) -> dict:
        """One row of ``capacity`` tokens: the documents' sequences back to back as segments 1..k, then padding.

        A document is one sample, or a unit of several sequences told apart by its attention mask's segment ids
        (a preference pair, a KTO couple: they keep their order, 2j-1 then 2j). Each sequence takes its CP-padded
        length (a multiple of ``multiple``): the pads end its segment, untrained, and are no real tokens
        (``pad_mask``, also returned: an outcome reward is read at a sequence's last real token)."""
        c = capacity or self.capacity
        multiple = multiple or self.cp_multiple
        row = {"input_ids": np.zeros(c, np.int64), "labels": np.full(c, IGNORE_INDEX, np.int64),
               "attention_mask": np.zeros(c, np.int64), "pad_mask": np.zeros(c, bool)}
        margins = [s["pair_margins"] for s in samples if "pair_margins" in s]
        pos, k = 0, 0
        for s in samples:
            ids = s["input_ids"]
            cuts = np.concatenate([[0], np.flatnonzero(np.diff(s["attention_mask"])) + 1, [len(ids)]])
            for a, b in zip(cuts[:-1], cuts[1:]):
                k += 1
                n = min(int(b - a), c - pos)
                span = min(round_up(n, multiple), c - pos)
                row["input_ids"][pos:pos + n] = ids[a:a + n]
                row["labels"][pos:pos + n] = s["labels"][a:a + n]
                row["attention_mask"][pos:pos + span] = k
                row["pad_mask"][pos + n:pos + span] = True
                pos += span
        if samples and len(margins) == len(samples):
            row["pair_margins"] = np.concatenate(margins)
        out = micro_batch([row], self.args, seq_length=c, isolate=True)
        out["pad_mask"] = torch.from_numpy(row["pad_mask"][None])
        return out


class DynamicCPBatchSource(BalancedBatchSource):
    """posttrain's data under ``--sequence-packing-scheduler default_dynamic_cp``: every sample of a global
    batch on the smallest CP group that holds it (:mod:`mindspeed_pack.packing.dynamic_cp`).

    The pool is this replica's data x context parallel ranks; every rank derives the step's plan from the
    samples' lengths and yields its ``M`` micro-batches: a job's whole row (``g x N`` tokens, samples laid
    out at their ``2g``-padded lengths) with ``cp_size`` = ``g`` and ``cp_rank`` = its place in the group, the
    trainer keeping its zigzag share; an empty row of ``N`` tokens where it has no job. Unpacked data only
    (``preprocess_data.py`` without ``--pack``, the long limit as ``--seq-length``); a sample longer than
    ``C x N`` is refused by name, or dropped and counted (``--overlong-samples drop``), never truncated.

    A document of preference pairs or KTO couples written without ``--pack`` is one *unit* (chosen + rejected,
    sample + KL partner): planned as one item, placed whole in one row on one group (its sequences padded each
    on its own), so a stage's per-pair sums are taken over that group alone. Each micro-batch names its
    documents in segment order (``documents``, one unit each: ``document_segments``), for the per-document
    data beside them (KTO labels, precomputed reference log-probs)."""

    dynamic_cp = True

    def setup(self, args, num_samples: dict) -> None:
        from megatron.core import parallel_state as ps

        PackedBatchSource.setup(self, args, num_samples)
        docs = next(d.docs for d in self.splits.values() if d is not None)
        require_unpacked(docs)
        self.online = True
        self.cost = cost_model(args)
        self.per_rank = args.max_seqlen_per_dp_cp_rank
        self.capacity = self.per_rank * args.context_parallel_size  # the longest sample
        self._sizes = {id(d.docs): unit_lengths(d.docs) for d in self.splits.values() if d is not None}
        self._plans = OrderedDict()
        for name, split in self.splits.items():
            if split is not None:
                check_overlong(self._sizes[id(split.docs)][split.start:split.end], split.start, args,
                               f"{split.docs.prefix!r} ({name} split)")
        self.pool_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        self.pool_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        check_dynamic_cp_groups(args.context_parallel_size)
        if not args.no_reset_position_ids:  # rows isolate their samples: positions restart per sample
            args.reset_position_ids = True
        log.info("default_dynamic_cp: %s on CP groups of %s ranks (rows of %d tokens per rank) over %d data x "
                 "context parallel ranks", UNIT_NAMES[units_per_document(docs)], "/".join(map(str, group_size_options(
                     args.context_parallel_size, args.min_dynamic_context_parallel_size))), self.per_rank,
                 self.pool_size)

    def _make_plan(self, dataset: SplitDataset, docs: np.ndarray) -> dict:
        """The step's dynamic CP plan: every rank's jobs (rows on groups of ranks), this rank's share."""
        docs, lengths, dropped = kept_samples(docs, self._sizes[id(dataset.docs)][docs], self.args)
        plan = step_plan(lengths, self.args, self.pool_size, self.cost)
        stats = plan.stats(lengths)
        if self.args.overlong_samples == "drop":
            stats["dropped samples"] = dropped
        return {"docs": docs, "jobs": plan.rank_jobs(self.pool_rank), "slots": plan.slots, "stats": stats}

    def step_shape(self, split: str, consumed: int):
        """(micro-batches, tokens per micro-batch *as megatron counts them*: N x --context-parallel-size, which
        its pipeline divides by the CP size to N per rank; the plan's statistics)."""
        plan = self._plan(split, consumed)
        return plan["slots"], self.capacity, plan["stats"]

    @property
    def max_tokens_per_cp_rank(self):
        return self.per_rank

    def micro_batches(self, split: str, consumed: int) -> Iterator[dict]:
        plan = self._plan(split, consumed)
        docs = self.splits[split].docs
        args = self.args
        for job in plan["jobs"]:
            if job is None:  # no job for this rank in this slot: an empty row, alone
                row = self._unit_row(docs, [], self.per_rank, 1)
                row.update(cp_size=1, cp_rank=0)
            else:
                g = job.size
                multiple = padding_multiple(g, args.tensor_model_parallel_size, args.sequence_parallel) if g > 1 else 1
                row = self._unit_row(docs, plan["docs"][job.samples], g * self.per_rank, multiple)
                row.update(cp_size=g, cp_rank=self.pool_rank - job.first_rank)
            yield row


UNIT_NAMES = {1: "samples", 2: "preference pairs / KTO couples (one unit per document, never split)"}


def units_per_document(docs) -> int:
    """Sequences per document of unpacked data: 2 for preference pairs and KTO couples written without
    ``--pack`` (segments 1 and 2 of its attention mask), else 1."""
    layout = (docs.meta or {}).get("layout") or {}
    return 2 if layout.get("kind") == "unpacked" and (layout.get("pairs") or layout.get("kto")) else 1


def unit_lengths(docs) -> np.ndarray:
    """Each document's sequence lengths: ``[documents]`` from the ``.idx`` (one sample each), or ``[documents,
    2]`` for pairs and couples (from their attention masks, read once)."""
    from mindspeed_pack.datasets.validation import document_segment_lengths

    segments = units_per_document(docs)
    if segments == 1:
        return np.asarray(docs.datasets["input_ids"].sequence_lengths, dtype=np.int64)
    return document_segment_lengths(docs, segments)


def step_plan(lengths, args, pool_size: int, cost) -> DynamicCPPlan:
    """One global batch's dynamic CP plan over ``pool_size`` data x context parallel ranks."""
    return plan_dynamic_cp(lengths, pool_size, args.max_seqlen_per_dp_cp_rank, args.context_parallel_size, cost,
                           args.min_dynamic_context_parallel_size, args.tensor_model_parallel_size,
                           args.sequence_parallel)


def largest_group_lengths(lengths, args) -> np.ndarray:
    """Tokens each sample (or unit) takes on the largest CP group: what must fit ``C x N``."""
    return planned_lengths(lengths, args.context_parallel_size, args.tensor_model_parallel_size,
                           args.sequence_parallel)


def kept_samples(docs: np.ndarray, lengths: np.ndarray, args):
    """(documents, lengths, how many were dropped) of a global batch without its samples over ``C x N`` once
    padded (they reach here only under ``--overlong-samples drop``)."""
    keep = largest_group_lengths(lengths, args) <= args.context_parallel_size * args.max_seqlen_per_dp_cp_rank
    return docs[keep], lengths[keep], int((~keep).sum())


def check_overlong(lengths: np.ndarray, first_document: int, args, where: str) -> int:
    """Samples (or units) of a split longer than ``C x N`` tokens once padded for the largest group (under
    ``dp_balanced``: the one group, a row): refused naming the first, or (``--overlong-samples drop``,
    ``default_dynamic_cp``) counted and logged; returns how many."""
    longest = args.context_parallel_size * args.max_seqlen_per_dp_cp_rank
    planned = largest_group_lengths(lengths, args)
    over = np.flatnonzero(planned > longest)
    if not len(over):
        return 0
    first = int(over[0])
    real = int(unit_totals(lengths)[first])
    multiple = padding_multiple(args.context_parallel_size, args.tensor_model_parallel_size, args.sequence_parallel)
    size = f"{real} tokens" + (f" ({int(planned[first])} with each sequence padded to a multiple of {multiple})"
                               if planned[first] != real else "")
    if args.overlong_samples == "refuse":
        drop = (", or pass --overlong-samples drop to drop them (counted)"
                if args.sequence_packing_scheduler == "default_dynamic_cp" else "")
        raise DataError(f"sample {first_document + first} of {where} has "
                        f"{size}, more than --context-parallel-size {args.context_parallel_size} "
                        f"x --max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} = {longest} "
                        f"({len(over)} such samples): raise either flag{drop}; they are never truncated")
    log.warning("--overlong-samples drop: %d of the %d samples of %s are longer than %d tokens and are dropped "
                "(counted per step as 'dropped samples')", len(over), len(lengths), where, longest)
    return len(over)


def require_unpacked(docs) -> None:
    """Dynamic CP packs samples at load time: offline packs are refused (by training and by ``--dry-run``)."""
    if data_kind(docs) != "unpacked":
        raise DataError(f"--sequence-packing-scheduler default_dynamic_cp packs samples at load time: "
                        f"{docs.prefix!r} holds offline packs; preprocess without --pack (each sample, "
                        "preference pair or KTO couple its own document, --seq-length the longest)")


def dynamic_cp_preview(args, steps: int = 2) -> List[str]:
    """``--dry-run`` under ``default_dynamic_cp``: the plan of the first training steps, from the documents'
    sizes in the ``.idx`` (and a pair's or couple's sequences from its attention mask) and the sample index built
    in memory (nothing is written)."""
    from mindspeed_pack.datasets.packed_dataset import split_ranges
    from mindspeed_pack.datasets.packed_documents import PackedDocuments
    from mindspeed_pack.datasets.sample_index import build_sample_index

    per_split = getattr(args, "train_data_path", None)
    docs = PackedDocuments((per_split or args.data_path)[0])
    require_unpacked(docs)
    start, end = (0, len(docs)) if per_split else split_ranges(len(docs), args.split)[0]
    sizes = unit_lengths(docs)
    check_overlong(sizes[start:end], start, args, f"{docs.prefix!r} (train split)")
    gbs = args.global_batch_size
    steps = min(steps, args.train_iters or steps)
    index = start + build_sample_index(end - start, steps * gbs, seed=args.seed, shuffle=not args.no_shuffle,
                                       padded_samples=args.padded_samples, global_batch_size=gbs)
    batches = []
    for step in range(steps):
        batch = index[step * gbs:(step + 1) * gbs]
        batches.append(kept_samples(batch, sizes[batch], args))  # (documents, lengths, dropped)
    return preview_lines(args, batches, "samples named by document")


def preview_lines(args, batches, naming: str) -> List[str]:
    """The dry run's lines for the first steps' ``batches`` ((names, lengths, dropped) each): the pool, then per
    step its figures and which ranks run which samples (by name) on which group size."""
    pool = args.data_parallel_size * args.context_parallel_size
    sizes_used = group_size_options(args.context_parallel_size, args.min_dynamic_context_parallel_size)
    lines = [f"dynamic CP: {pool} data x context parallel ranks, CP groups of {'/'.join(map(str, sizes_used))} "
             f"ranks, {args.max_seqlen_per_dp_cp_rank} tokens per rank per micro-batch; {naming}"]
    for step, (names, lengths, dropped) in enumerate(batches):
        plan = step_plan(lengths, args, pool, cost_model(args))
        figures = ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in plan.stats(lengths).items())
        lines.append(f"step {step + 1}: {plan.slots} micro-batch{'' if plan.slots == 1 else 'es'}; {figures}; "
                     f"padding {plan.padding_ratio(lengths):.3f}"
                     + (f"; {dropped} samples dropped" if dropped else ""))
        lines += [f"  {line}" for line in plan.describe(names=names)]
    return lines


def batch_source(args) -> PackedBatchSource:
    """The posttrain data source for ``--sequence-packing-scheduler``."""
    if args.sequence_packing_scheduler == "default_dynamic_cp":
        return DynamicCPBatchSource()
    return BalancedBatchSource() if args.sequence_packing_scheduler == "dp_balanced" else PackedBatchSource()
