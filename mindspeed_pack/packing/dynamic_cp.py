"""Dynamic context parallelism: per step, every sample runs on the smallest CP group that holds it.

``--sequence-packing-scheduler default_dynamic_cp`` (Megatron-LM's name), ``--max-seqlen-per-dp-cp-rank N``,
``--context-parallel-size C`` (the largest group). The ``W = DP x C`` ranks of a replica's data x context
parallel group are one pool. A sample of ``n`` tokens needs ``g`` ranks, the smallest power of two (at least
``--min-dynamic-context-parallel-size``) whose row of ``g x N`` tokens holds it once padded for the zigzag
split (to ``2g``, x TP under sequence parallelism; on one rank nothing is padded). Rows are packed best-fit
decreasing over all widths (:func:`pack_rows`): a long sample opens a row of its own ``g``, and shorter samples
fill the room it leaves (they then run split over that group, which exchanges its ranks' whole shares
whatever they hold: no extra communication) or rows of their own::

    N = 8, C = 4, W = 4       sample   s0 s1 s2 s3  s4 s5      lengths 3 5 2 12 30 6
    own group size g                   1  1  1  2   4  1
    rows (g x N tokens)       [s4] (g=4)   [s0 s3] (g=2: s3 = 12 -> 12, s0 = 3 -> 4)   [s2 s5] (g=1)   [s1] (g=1)

Groups are aligned blocks of the pool (ranks ``[k g, (k+1) g)``: the sub-groups made once at start). A step
is ``M`` slots (micro-batches); in each slot the pool is split into blocks, each running one job::

    slot 0:  ranks 0-3  [s4]
    slot 1:  ranks 0-1  [s0 s3]     rank 2  [s2 s5]     rank 3  [s1]

``M = ceil(sum of job widths / W)``, the fewest slots: power-of-two widths that divide ``W`` fill the slots
exactly when placed widest first. Where the rows leave rank-slots empty, single-rank rows of several samples are
split onto them (:func:`_fill_empty_rows`), so a step of short samples runs on every rank. Every rank runs ``M``
micro-batches of ``N`` tokens (one shape for the pipeline stages; a slot where a rank has no job is an empty row). Jobs go widest first, costliest first, to
the block with the least load so far among those with a free slot (a job's load on each of its ranks is its
samples' cost / ``g``, :class:`~.balance.CostModel`, the cost model of ``dp_balanced``). Since every job
placed before one of width ``g`` covers whole ``g``-blocks, the ranks of a block always have the same load
and the same free slots.

A *unit* is what must run whole on one group: a sample, or a preference pair (chosen + rejected) or a KTO
couple (sample + its KL partner), whose sequences a stage compares. ``lengths`` is ``[units]`` (one sequence
each) or ``[units, sequences]`` (0 where a unit has fewer): a unit is one item of the plan, placed in one row
on one group; each of its sequences is padded on its own for the zigzag split, as every segment is.

Deterministic (numpy and the C++ packer, ties by index): every rank derives the same plan from the same lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from mindspeed_pack.packing.balance import CostModel, imbalance
from mindspeed_pack.packing.binpack import pack_lengths
from mindspeed_pack.packing.context_parallel import padding_multiple, round_up


def group_size_options(max_cp: int, min_cp: int = 1) -> List[int]:
    """The CP group sizes a run may use: powers of two from ``min_cp`` to ``max_cp``."""
    sizes, g = [], min_cp
    while g <= max_cp:
        sizes.append(g)
        g *= 2
    return sizes


def unit_totals(lengths) -> np.ndarray:
    """Real tokens of each unit (``lengths`` ``[units]`` or ``[units, sequences]``)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return lengths if lengths.ndim == 1 else lengths.sum(-1)


def unit_costs(model: CostModel, lengths) -> np.ndarray:
    """Estimated cost of each unit: its sequences' costs (attention is quadratic per sequence)."""
    costs = model.sample_costs(lengths)
    return costs if costs.ndim == 1 else costs.sum(-1)


def planned_lengths(lengths, group: int, tp: int = 1, sequence_parallel: bool = False) -> np.ndarray:
    """Tokens each unit takes in a row of a ``group``-rank CP group: every sequence padded to ``2 x group`` (x TP
    under sequence parallelism) for the zigzag split; on one rank, its own length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    padded = lengths if group == 1 else round_up(lengths, padding_multiple(group, tp, sequence_parallel))
    return unit_totals(padded)


def group_sizes(lengths, per_rank: int, max_cp: int, min_cp: int = 1, tp: int = 1,
                sequence_parallel: bool = False) -> np.ndarray:
    """Each unit's CP group size: the smallest allowed ``g`` whose ``g x per_rank`` tokens hold it once
    padded (0: longer than ``max_cp x per_rank``, no group holds it)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.zeros(len(lengths), np.int64)
    for g in group_size_options(max_cp, min_cp):
        fits = (out == 0) & (planned_lengths(lengths, g, tp, sequence_parallel) <= g * per_rank)
        out[fits] = g
    return out


@dataclass
class Job:
    """One row: the batch positions of its samples (data order) on a group of ``size`` ranks."""

    size: int
    samples: np.ndarray
    cost: float  # on each of its ranks
    first_rank: int = -1  # its group: ranks [first_rank, first_rank + size) of the pool
    slot: int = -1  # the micro-batch it is


@dataclass
class DynamicCPPlan:
    """A step's jobs placed on the pool of ``num_ranks`` ranks in ``slots`` micro-batches."""

    num_ranks: int
    per_rank: int
    slots: int
    jobs: List[Job]
    rank_costs: np.ndarray = field(default=None)

    def rank_jobs(self, rank: int) -> List[Optional[Job]]:
        """The job of every slot of ``rank`` (None: an empty row)."""
        out: List[Optional[Job]] = [None] * self.slots
        for job in self.jobs:
            if job.first_rank <= rank < job.first_rank + job.size:
                out[job.slot] = job
        return out

    def stats(self, lengths) -> dict:
        """The step's figures, the same on every rank: samples per CP size, rank imbalance (max / mean
        estimated cost) and real tokens per rank (max / mean)."""
        lengths = unit_totals(lengths)
        tokens = np.zeros(self.num_ranks)
        out = {}
        for job in self.jobs:
            real = float(lengths[job.samples].sum())
            tokens[job.first_rank:job.first_rank + job.size] += real / job.size
            key = f"samples at CP {job.size}"
            out[key] = out.get(key, 0) + len(job.samples)
        out = {k: out[k] for k in sorted(out, key=lambda k: int(k.rsplit(" ", 1)[1]))}
        out["rank imbalance"] = imbalance(self.rank_costs)
        out["tokens per rank max/mean"] = imbalance(tokens)
        return out

    def padding_ratio(self, lengths) -> float:
        """The share of the step's rows (``slots x num_ranks x per_rank`` tokens) that is padding."""
        real = sum(int(unit_totals(lengths)[job.samples].sum()) for job in self.jobs)
        return 1.0 - real / (self.num_ranks * self.slots * self.per_rank)

    def describe(self, names=None) -> List[str]:
        """One line per slot: which ranks run which samples (``names[i]`` for batch position ``i``, e.g. its
        document) on which group size."""
        lines = []
        for slot in range(self.slots):
            parts, covered = [], set()
            for job in sorted((j for j in self.jobs if j.slot == slot), key=lambda j: j.first_rank):
                ranks = (f"rank {job.first_rank}" if job.size == 1
                         else f"ranks {job.first_rank}-{job.first_rank + job.size - 1}")
                samples = job.samples if names is None else np.asarray(names)[job.samples]
                parts.append(f"{ranks}: CP {job.size} samples {samples.tolist()}")
                covered.update(range(job.first_rank, job.first_rank + job.size))
            empty = [r for r in range(self.num_ranks) if r not in covered]
            if empty:
                parts.append(f"empty rows on rank{'s' if len(empty) > 1 else ''} {','.join(map(str, empty))}")
            lines.append(f"micro-batch {slot}: " + "; ".join(parts))
        return lines


def pack_rows(lengths, sizes, per_rank: int, tp: int = 1, sequence_parallel: bool = False) -> List[tuple]:
    """Rows of ``(group size, batch positions)``: best-fit decreasing over rows of every width.

    Longest first, each sample goes to the open row it fills best among those at least as wide as its own
    group size (its length padded for that row's group), else opens a row of its own size. A long sample's
    row is rarely full (a 9k sample at N = 8k takes a 16k row): shorter samples fill it, at no extra
    communication, since a CP group exchanges every rank's whole share whatever it holds. The rows of the
    narrowest width are then packed again when the C++ packer needs fewer (:func:`_repack_narrowest`)."""
    lengths, sizes = np.asarray(lengths, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    order = np.lexsort((np.arange(len(lengths)), -unit_totals(lengths), -sizes))  # widest, longest, then data order
    options = np.unique(sizes)  # the group sizes in use, ascending: a row's width is one of them
    planned = np.stack([planned_lengths(lengths, int(g), tp, sequence_parallel) for g in options])  # [width, sample]
    row_option = np.zeros(len(lengths), np.int64)  # per row (at most one per sample): index into options
    room = np.zeros(len(lengths), np.int64)
    members: List[List[int]] = []
    for i in order:
        k = int(np.searchsorted(options, sizes[i]))
        n = len(members)
        left = room[:n] - planned[row_option[:n], i]
        fits = np.flatnonzero((row_option[:n] >= k) & (left >= 0))
        if len(fits):
            r = int(fits[np.argmin(left[fits])])  # best fit; ties: the oldest row
        else:
            r = n
            row_option[r], room[r] = k, int(options[k]) * per_rank
            members.append([])
        room[r] -= planned[row_option[r], i]
        members[r].append(int(i))
    rows = [(int(options[row_option[r]]), np.array(sorted(m), np.int64)) for r, m in enumerate(members)]
    return _repack_narrowest(rows, int(options[0]), planned[0], per_rank)


def _repack_narrowest(rows: List[tuple], width: int, planned: np.ndarray, per_rank: int) -> List[tuple]:
    """``rows`` with those of the narrowest width packed again by the C++ packer (best-fit decreasing plus its
    exact-fill pass, :mod:`~.binpack`) when that takes fewer of them: only samples of that size are in them (wider
    ones open wider rows), and on many short samples plain best-fit leaves a few bins' worth of gaps, which can
    cost the step a micro-batch. ``planned``: every sample's tokens in a row of that ``width``."""
    narrow = [samples for w, samples in rows if w == width]
    if len(narrow) < 2:
        return rows
    items = np.concatenate(narrow)
    plan = pack_lengths(planned[items], width * per_rank)
    if plan.num_bins >= len(narrow):
        return rows
    return [row for row in rows if row[0] != width] + [(width, np.sort(items[b])) for b in plan.bins()]


def _fill_empty_rows(jobs: List[Job], empty: int, costs: np.ndarray) -> List[Job]:
    """``jobs`` with single-rank rows of several samples split in two while the step has ``empty`` rank-slots
    (rows no job would fill): the costliest such row first, its samples dealt costliest first to the lighter
    half. The fewest slots leave ranks idle when the rows do not fill the last one (8 short samples of a step
    fit one row: one rank ran them all, the other an empty row, rank imbalance 2.0); a split row takes one of
    those slots, so the step keeps its micro-batches and its ranks share the work (as ``dp_balanced`` splits a
    row for a rank short of rows). Wider rows stay whole: their group exchanges whole shares anyway."""
    jobs = list(jobs)
    while empty > 0:
        narrow = [j for j in jobs if j.size == 1 and len(j.samples) > 1]
        if not narrow:
            break
        job = max(narrow, key=lambda j: (j.cost, -int(j.samples[0])))  # ties: the earliest row
        halves, loads = ([], []), [0.0, 0.0]
        for i in sorted(job.samples.tolist(), key=lambda i: (-costs[i], i)):
            h = int(loads[1] < loads[0])
            halves[h].append(i)
            loads[h] += float(costs[i])
        jobs = [j for j in jobs if j is not job]
        jobs += [Job(1, np.array(sorted(h), np.int64), load) for h, load in zip(halves, loads)]
        empty -= 1
    return jobs


def plan_dynamic_cp(lengths, num_ranks: int, per_rank: int, max_cp: int, model: CostModel, min_cp: int = 1,
                    tp: int = 1, sequence_parallel: bool = False) -> DynamicCPPlan:
    """Group sizes, rows and their placement for one global batch's samples (see the module docstring).

    ``lengths``: the units' token counts (``[units]``, or ``[units, sequences]``), each at most ``max_cp x
    per_rank`` once padded (the caller refuses or drops longer ones); ``num_ranks`` a multiple of ``max_cp``, a
    power of two."""
    lengths = np.asarray(lengths, dtype=np.int64)
    sizes = group_sizes(lengths, per_rank, max_cp, min_cp, tp, sequence_parallel)
    if (sizes == 0).any():
        i = int(np.flatnonzero(sizes == 0)[0])
        raise ValueError(f"sample {i} of {unit_totals(lengths)[i]} tokens is longer than {max_cp} x {per_rank}")
    costs = unit_costs(model, lengths)
    jobs = [Job(g, samples, float(costs[samples].sum()) / g)
            for g, samples in pack_rows(lengths, sizes, per_rank, tp, sequence_parallel)]
    slots = max(1, -(-sum(j.size for j in jobs) // num_ranks))
    jobs = _fill_empty_rows(jobs, slots * num_ranks - sum(j.size for j in jobs), costs)
    used = np.zeros(num_ranks, np.int64)  # slots taken on every rank
    load = np.zeros(num_ranks)
    # widest first, then costliest, then data order
    for job in sorted(jobs, key=lambda j: (-j.size, -j.cost, int(j.samples[0]))):
        starts = np.arange(0, num_ranks, job.size)
        free = starts[used[starts] < slots]
        block = int(free[np.argmin(load[free])])  # argmin: the first (lowest) of equal loads
        job.first_rank, job.slot = block, int(used[block])
        used[block:block + job.size] += 1
        load[block:block + job.size] += job.cost
    jobs.sort(key=lambda j: (j.slot, j.first_rank))
    return DynamicCPPlan(num_ranks, per_rank, slots, jobs, load)
