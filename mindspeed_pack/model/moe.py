"""Mixture-of-experts layers that route samples, not packs.

megatron-core's MoE (router, token dispatcher, experts) with one change: the router knows
which sample each token of the packed micro-batch belongs to (``routing_segments``: 1..n
per sample, 0 for padding, see :class:`~mindspeed_pack.packing.segments.PackedBatch`)::

    tokens            a0 a1 a2 b0 b1 P  P
    routing_segments  1  1  1  2  2  0  0
    routed            y  y  y  y  y  -  -      (pads reach no expert: zero routing row)

so that

- pads reach no expert and count in no routing statistic (``aux_loss``, ``seq_aux_loss``,
  the per-expert load): their routing rows are cleared after top-k;
- ``seq_aux_loss`` is the mean over the micro-batch's *samples* of each sample's own
  load-balancing loss, exactly as if every sample were its own sequence (megatron-core
  takes a THD micro-batch as one sequence);
- ``aux_loss`` is computed over the micro-batch's real tokens.

Under sequence or context parallelism a rank holds part of every sample: the per-sample
expert counts are summed over the TP x CP group, so each sample's statistic is that of the
whole sample, whatever the split. Under dynamic context parallelism
(``--sequence-packing-scheduler default_dynamic_cp``) a micro-batch's samples are split over the CP
group its plan chose (``local_cp_size`` ranks; alone when 1): the counts are summed over TP, then over that
group (:meth:`PackedTopKRouter.sample_groups`), never over megatron's fixed CP group.

Routing is dropless unless ``--moe-expert-capacity-factor`` is set, so a token's experts do
not depend on its pack-mates. The trainer hands each micro-batch's segments to the routers
(:func:`set_routing_segments`) just before the forward, and reads the step's statistics
back with :func:`step_statistics`.

The step's load-balancing loss is the mean of the micro-batches' losses weighted by what each
averages over, its routed tokens (``aux_loss``) or samples (``seq_aux_loss``), over the whole
global step: for ``seq_aux_loss`` that is the mean over the step's samples, whatever the
packing. Its gradient is ``coeff x grad`` of that, whatever the stage divides its own loss by
(tokens, samples, pairs): the trainer divides every gradient by the stage's normaliser, which
:func:`scale_aux_loss` hands the routers before the step (megatron-core assumes the routed tokens).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    topk_routing_with_score_function,
)
from megatron.core.transformer.moe.router import TopKRouter
from torch.distributed import ReduceOp

from mindspeed_pack.runtime.process_groups import dynamic_cp_group

# megatron-core 0.16.1 binds TE's router GEMM only when TE imports, then reads the name anyway:
# without TE the router's gating falls back to torch.mm once the name exists (as None)
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")


def moe_config_kwargs(args) -> dict:
    """TransformerConfig's MoE fields from Megatron-LM's flags (empty for a dense model)."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    # a converter's namespace carries the model shape only: training settings take Megatron-LM's defaults
    return dict(
        num_moe_experts=experts,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None) or args.ffn_hidden_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=getattr(args, "moe_router_load_balancing_type", "aux_loss"),
        moe_aux_loss_coeff=getattr(args, "moe_aux_loss_coeff", 0.0),
        moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False),
        moe_token_dispatcher_type=getattr(args, "moe_token_dispatcher_type", "allgather"),
        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", False),
        moe_expert_capacity_factor=getattr(args, "moe_expert_capacity_factor", None),
        moe_layer_freq=moe_layer_pattern(args),
        expert_model_parallel_size=getattr(args, "expert_model_parallel_size", 1),
        moe_router_dtype="fp32",
    )


def moe_layer_pattern(args) -> List[int]:
    """1 for an MoE layer, 0 for a dense one, per global layer (Megatron-LM's ``--moe-layer-freq``:
    a list as is, N = every N-th layer)."""
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, list):
        return list(freq)
    return [int(i % freq == 0) for i in range(args.num_layers)]


class PackedTopKRouter(TopKRouter):
    """Top-k router whose statistics and auxiliary losses see samples (segments), not the pack."""

    def __init__(self, config, pg_collection=None) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.routing_segments: Optional[torch.Tensor] = None  # [T] this micro-batch's, set by the trainer
        self.routing_groups: Optional[int] = None  # above its largest routing segment, known on the host
        # dynamic context parallelism: the ranks of the micro-batch's own CP group (None: megatron's CP group)
        self.local_cp_size: Optional[int] = None
        # the step's aux-loss gradient scale per unit (a number or a 0-dim tensor), set by the trainer
        # (:func:`scale_aux_loss`); 1 until then: megatron-core's convention (gradients divided by routed tokens)
        self.aux_loss_scale = 1.0
        self.reset_statistics()

    def reset_statistics(self) -> None:
        """The step's statistics, accumulated on the device (read once, by :func:`step_statistics`)."""
        device = self.weight.device
        self.step_tokens_per_expert = torch.zeros(self.config.num_moe_experts, dtype=torch.float64, device=device)
        # sum over micro-batches of this layer's loss (without the coefficient) x its units (tokens or samples)
        self.step_aux_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.step_units = torch.zeros((), dtype=torch.float64, device=device)

    def _local_segments(self, num_tokens: int) -> Optional[torch.Tensor]:
        """This rank's share of the segment ids (sequence parallelism splits the tokens over TP)."""
        seg = self.routing_segments
        if seg is None:
            return None
        seg = seg.reshape(-1)
        if seg.numel() != num_tokens:
            parts = seg.numel() // num_tokens
            if parts * num_tokens != seg.numel() or parts != self.tp_group.size():
                raise ValueError(f"routing segments hold {seg.numel()} tokens, the router sees {num_tokens}")
            seg = seg.view(parts, num_tokens)[self.tp_group.rank()]
        return seg.to(self.weight.device)

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """megatron's top-k routing, then pads' rows cleared; statistics and aux losses by sample.
        (``padding_mask`` is megatron-core's own argument: the routing segments replace it.)"""
        logits = logits.view(-1, self.config.num_moe_experts)
        seg = self._local_segments(logits.shape[0])
        probs, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=self.config.moe_router_pre_softmax,
            num_groups=self.config.moe_router_num_groups, group_topk=self.config.moe_router_group_topk,
            scaling_factor=self.config.moe_router_topk_scaling_factor, score_function=self.score_function,
            expert_bias=self.expert_bias, fused=self.config.moe_router_fusion, router_replay=self.router_replay)
        if seg is not None:
            real = (seg != 0).unsqueeze(-1)
            routing_map = routing_map & real  # pads go to no expert
            probs = probs * real
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy,
                pad_to_capacity=self.config.moe_pad_expert_input_to_capacity)
        if self.training and torch.is_grad_enabled():
            with torch.no_grad():
                self.step_tokens_per_expert += routing_map.sum(0).double()
            coeff = self.config.moe_aux_loss_coeff
            if self.routing_type in ("aux_loss", "seq_aux_loss"):
                scores = torch.softmax(logits.float(), dim=-1) if self.score_function == "softmax" else \
                    torch.sigmoid(logits.float()) / torch.sigmoid(logits.float()).sum(-1, keepdim=True)
                top = torch.zeros_like(routing_map).scatter(1, torch.topk(scores, self.topk, dim=1).indices, True)
                if seg is None:
                    seg = torch.ones(logits.shape[0], dtype=torch.long, device=logits.device)
                aux_loss, units, full = self._load_balancing_loss(scores, top, seg)
                # every rank holding part of the micro-batch records it: each its share, so the job's sum counts
                # it once whatever the group's size (dynamic CP mixes sizes in one step)
                share = 1.0 / self.sample_ranks()
                self.step_aux_loss += full.detach().double() * units.detach().double() * share
                self.step_units += units.detach().double() * share
                if coeff:  # weighted by its units, scaled to the stage's normaliser (scale_aux_loss)
                    probs = MoEAuxLossAutoScaler.apply(probs, coeff * aux_loss * units * self.aux_loss_scale)
        return probs, routing_map

    def _load_balancing_loss(self, scores: torch.Tensor, top: torch.Tensor, seg: torch.Tensor):
        """(loss, units, full loss) of the Switch load-balancing loss ``E/k * sum_e f_e P_e`` over real
        tokens: of the whole micro-batch (``aux_loss``; units: its real tokens) or of each sample,
        averaged over samples (``seq_aux_loss``; units: its samples). Units count the whole
        micro-batch (all sequence / context parallel ranks)."""
        experts = self.config.num_moe_experts
        if self.routing_type == "aux_loss":
            groups, n = (seg != 0).long(), 2  # one group: every real token
        else:  # the micro-batch's groups (not this rank's share: sequence and context parallelism split samples)
            groups = seg
            n = self.routing_groups or (int(self.routing_segments.max()) + 1 if self.routing_segments is not None
                                        else 2)
        real = (groups != 0).float().unsqueeze(-1)
        prob_sums = torch.zeros(n, experts, dtype=scores.dtype, device=scores.device).index_add(
            0, groups, scores * real)
        counts = torch.zeros(n, experts, dtype=torch.float32, device=scores.device).index_add(
            0, groups, (top.float() * real))
        for group in self.sample_groups():  # sequence / context parallel: each rank holds part of every sample
            counts = _all_reduce(counts, group)
        tokens = counts.sum(-1) / self.topk  # real tokens per group (all ranks)
        per_group = (prob_sums * counts).sum(-1) / (tokens.clamp(min=1) ** 2)
        per_group = per_group[1:] * experts / self.topk
        present = tokens[1:] > 0  # (absent groups' terms are 0; selected by where: no boolean indexing)
        loss = torch.where(present, per_group, torch.zeros_like(per_group)).sum() / present.sum().clamp(min=1)
        # what the loss is a mean over (all sequence-parallel ranks': each rank's partial loss is a share of one loss)
        units = tokens[1:].sum() if self.routing_type == "aux_loss" else present.sum().to(tokens.dtype)
        # the full loss for the statistics (each sequence-parallel rank holds a part of it)
        full = loss.detach()
        for group in self.sample_groups():
            full = _all_reduce(full, group)
        return loss, units, full

    def sample_groups(self) -> list:
        """The groups over which this micro-batch's samples are split, to sum a statistic over in turn: megatron's
        TP x CP group, or under dynamic context parallelism TP, then the CP group the plan chose for the
        micro-batch (none when it runs on one rank)."""
        if self.local_cp_size is None:
            groups = [self.tp_cp_group]
        else:
            groups = [self.tp_group, dynamic_cp_group(self.local_cp_size)]
        return [g for g in groups if g is not None and g.size() > 1]

    def sample_ranks(self) -> int:
        """How many ranks hold parts of this micro-batch's samples (the product of :meth:`sample_groups`)."""
        return math.prod(g.size() for g in self.sample_groups())


def _all_reduce(t: torch.Tensor, group, op=None) -> torch.Tensor:
    t = t.detach().clone()
    torch.distributed.all_reduce(t, op=op or ReduceOp.SUM, group=group)
    return t


def routers(model) -> List[PackedTopKRouter]:
    """The packed routers of a model chunk (cached on it)."""
    found = getattr(model, "_packed_routers", None)
    if found is None:
        found = [m for m in model.modules() if isinstance(m, PackedTopKRouter)]
        model._packed_routers = found
    return found


def set_routing_segments(model, routing_segments: Optional[torch.Tensor], groups: Optional[int] = None,
                         local_cp_size: Optional[int] = None) -> None:
    """The micro-batch's routing segments for the routers; ``groups``: a bound above the largest, known on the
    host for the whole micro-batch (the same on every TP and CP rank; without it the routers read it back);
    ``local_cp_size``: under dynamic context parallelism, the size of the micro-batch's own CP group."""
    for router in routers(model):
        router.routing_segments = routing_segments
        router.routing_groups = groups
        router.local_cp_size = local_cp_size


def scale_aux_loss(model_chunks, batches, normaliser) -> None:
    """Before a training step: scale the routers' aux-loss gradients to the stage's ``normaliser``
    (this rank's share of what the trainer divides every gradient by; summed here over DP x CP).

    A micro-batch's aux loss enters with weight ``units x N / U`` (``N`` the step's normaliser,
    ``U`` its routed tokens or samples), so that after the division by ``N`` the gradient is
    ``coeff x grad`` of the step's unit-weighted mean aux loss. Every rank of the DP x CP group
    must call it (a collective). ``batches``: this rank's micro-batches (its CP share)."""
    chunk_routers = [r for chunk in model_chunks for r in routers(chunk)]
    # the whole DP x CP group holds the same layers: all of it returns here, or none of it
    if not chunk_routers or chunk_routers[0].routing_type not in ("aux_loss", "seq_aux_loss") or \
            not chunk_routers[0].config.moe_aux_loss_coeff:
        return
    device = batches[0].routing_segments.device
    if chunk_routers[0].routing_type == "seq_aux_loss":  # samples: counted on CP rank 0 (the CP split's rule)
        units = torch.full((), float(sum(b.num_samples for b in batches)), device=device)
    else:  # routed tokens: this rank's CP share of each micro-batch
        units = sum((b.routing_segments != 0).sum() for b in batches)
    # on the device throughout: the step does not wait for it
    totals = torch.stack([torch.as_tensor(normaliser, device=device).float(), units.float()])
    torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))
    n, u = totals
    # a step with nothing trained: megatron-core leaves the gradients undivided (the aux loss still balances)
    scale = torch.where(n > 0, n, 1.0) / u.clamp(min=1)
    for r in chunk_routers:
        r.aux_loss_scale = scale


def step_statistics(model_chunks, num_layers: int, num_experts: int) -> Dict[str, object]:
    """The step's auxiliary loss and per-expert load over the whole job; resets the routers.

    ``moe aux loss``: mean over MoE layers of each layer's step loss (without the coefficient;
    micro-batches weighted by their routed tokens or samples, as in its gradient); ``expert load
    max/mean``: the most loaded expert's tokens over the mean, averaged over MoE layers (1.0 =
    balanced); ``tokens per expert``: one list per MoE layer.
    Every rank must call it (collectives over the pipeline and data-parallel groups).
    """
    found = [r for chunk in model_chunks for r in routers(chunk)]
    device = found[0].weight.device if found else \
        (torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu")
    loads = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
    # loss x units, units: each rank holding part of a micro-batch recorded its share, so the sum counts it once
    aux = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
    for r in found:
        loads[r.layer_number - 1] += r.step_tokens_per_expert
        aux[r.layer_number - 1] += torch.stack([r.step_aux_loss, r.step_units])
        r.reset_statistics()
    flat = torch.cat([loads.reshape(-1), aux.reshape(-1)])
    torch.distributed.all_reduce(flat, group=ps.get_pipeline_model_parallel_group())
    # routers of one sequence-parallel group count disjoint tokens; expert-parallel ranks are data-parallel
    torch.distributed.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
    torch.distributed.all_reduce(flat, group=ps.get_data_parallel_group(with_context_parallel=True))
    flat = flat.cpu()
    loads = flat[:loads.numel()].view(num_layers, num_experts)
    aux = flat[loads.numel():].view(num_layers, 2)
    out: Dict[str, object] = {}
    moe_layers = loads.sum(-1) > 0
    if moe_layers.any():
        mean = loads[moe_layers].mean(-1)
        out["expert load max/mean"] = float((loads[moe_layers].max(-1).values / mean).mean())
        out["tokens per expert"] = [[int(x) for x in row] for row in loads[moe_layers].tolist()]
    with_aux = aux[:, 1] > 0
    if with_aux.any():
        out["moe aux loss"] = float((aux[with_aux, 0] / aux[with_aux, 1]).mean())
    return out
