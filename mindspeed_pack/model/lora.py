"""LoRA adapters on megatron-core's tensor-parallel linears, put in place by the layer spec.

A LoRA linear is the base linear (megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` or
TE's) plus ``scale * B_p A_p x`` for every projection ``p`` it fuses, with its own A and B, as
PEFT has for the separate Hugging Face projections::

    linear_qkv   q_proj k_proj v_proj   column-parallel: A_p [r, in] replicated, B_p [rows_p / TP, r]
    linear_fc1   gate_proj up_proj        split by output (rank t: the rows of its query groups / FFN slice)
    linear_proj  o_proj                 row-parallel: A [r, in / TP] split by input, B [out, r] replicated
    linear_fc2   down_proj

Parameters ``<linear>.lora_A.<p>`` / ``<linear>.lora_B.<p>``; each B_p keeps its rows in the HF
order, and the projections' outputs are interleaved into the base's fused layout (QKV per query
group, ``[gate; up]``) in the forward only, so the export is a renaming
(:mod:`mindspeed_pack.convert.adapters`). ``--lora-dropout`` draws a mask per projection, as PEFT's
separate modules do (without dropout the projections' A run as one matmul). ``scale = alpha / r``
(``alpha / sqrt(r)`` with rsLoRA); B starts at zero, so the adapted model starts as the base model
exactly. The base is frozen: megatron's DDP and optimizers then keep no gradient buffer and no state
for it. An outcome reward model's score head is no adapter: it trains in full beside them (PEFT's
``modules_to_save``, :data:`TRAINED_IN_FULL`), and is saved and exported with them.

Only the rank-r activations ``h = A x`` cross tensor-parallel ranks:

* column: ``h`` is the same on every rank; its gradient is summed over TP (the base sums the
  input gradient the same way). Under sequence parallelism ``h`` is computed on the sequence
  shard and all-gathered (gradient reduce-scattered); A's gradient, from one shard per rank, is
  then summed by ``finalize_model_grads`` (the ``sequence_parallel`` attribute, as for norms).
* row: ``h = sum_t A_t x_t`` is all-reduced (reduce-scattered to the sequence shard under SP, where
  B's gradient is then summed like A's above).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec

from mindspeed_pack.model.score_head import SCORE
from mindspeed_pack.model.traced_mappings import (  # megatron-core's, traceable inside a compiled layer
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

log = logging.getLogger(__name__)

# megatron linear (its module path in a layer) -> the projections it fuses, by their Hugging Face names
ADAPTED_LINEARS: Dict[str, Tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
COLUMN_PARALLEL = ("self_attention.linear_qkv", "mlp.linear_fc1")  # the others are row-parallel
ALL_LINEAR = "all-linear"


def _short(linear: str) -> str:
    return linear.rsplit(".", 1)[1]


def valid_target_names() -> str:
    megatron = " ".join(_short(k) for k in ADAPTED_LINEARS)
    hf = " ".join(p for parts in ADAPTED_LINEARS.values() for p in parts)
    return f"{megatron} (megatron), {hf} (Hugging Face), {ALL_LINEAR}"


def target_names(names) -> list:
    """``--lora-target-modules`` as given -> its names: a comma list split (LLaMA-Factory's ``lora_target:
    q_proj,v_proj``, a config file's one string) and its ``all`` read as :data:`ALL_LINEAR`."""
    out = [part.strip() for name in names for part in str(name).split(",") if part.strip()]
    return [ALL_LINEAR if name == "all" else name for name in out]


def resolve_targets(names) -> Tuple[Tuple[str, str], ...]:
    """``--lora-target-modules`` names -> sorted ``(linear, projection)`` pairs; ValueError names the valid ones."""
    out = set()
    for name in target_names(names):
        if name == ALL_LINEAR:
            out |= {(linear, p) for linear, parts in ADAPTED_LINEARS.items() for p in parts}
            continue
        found = [(linear, p) for linear, parts in ADAPTED_LINEARS.items() for p in parts
                 if name in (_short(linear), linear, p)]
        if not found:
            raise ValueError(f"--lora-target-modules: unknown module {name!r}; valid names: {valid_target_names()}")
        out |= set(found)
    return tuple(sorted(out))


@dataclass(frozen=True)
class LoRASettings:
    r: int
    alpha: float
    dropout: float
    targets: Tuple[Tuple[str, str], ...]  # (linear, projection) pairs that get an adapter
    rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.rslora else self.r)

    def projections(self, linear: str) -> Tuple[str, ...]:
        return tuple(p for p in ADAPTED_LINEARS[linear] if (linear, p) in self.targets)

    def record(self) -> dict:
        """What checkpoints and exports record (plain data)."""
        return {"r": self.r, "alpha": self.alpha, "dropout": self.dropout, "rslora": self.rslora,
                "targets": [f"{linear}.{p}" for linear, p in self.targets]}


def trains_adapters(args) -> bool:
    """Whether this run trains LoRA adapters over a frozen base: every place that differs under LoRA
    (loading, initialisation, the DPO reference, export) asks this instead of reading the flags.

    ``--lora-r`` is set whenever a LoRA flag is given (``--lora-target-modules`` alone: the parser's default
    rank). ``getattr``: converter and model-shape namespaces have no LoRA flags."""
    return bool(getattr(args, "lora_r", None))


def settings_from_args(args) -> Optional[LoRASettings]:
    """The run's LoRA settings (None without ``--lora-r``); ``args`` validated by the training parser."""
    if not trains_adapters(args):
        return None
    return LoRASettings(r=int(args.lora_r), alpha=float(args.lora_alpha), dropout=float(args.lora_dropout or 0.0),
                        targets=resolve_targets(args.lora_target_modules or [ALL_LINEAR]),
                        rslora=bool(getattr(args, "lora_use_rslora", False)))


def adapter_parameters(settings: LoRASettings, args, tp: int = 1) -> int:
    """Adapter parameters one tensor-parallel rank holds (``tp`` 1: the whole model's), from the model flags:
    ``r x (in + out)`` per adapted projection, with the factor that meets the base's split divided by ``tp`` (A of
    a row-parallel linear, B of a column-parallel one) and the other replicated; MoE layers' MLPs carry none."""
    h, heads = args.hidden_size, args.num_attention_heads
    d = getattr(args, "kv_channels", None) or h // heads
    groups = getattr(args, "num_query_groups", None) or heads
    ffn = getattr(args, "ffn_hidden_size", None) or 4 * h
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, groups * d), "v_proj": (h, groups * d), "o_proj": (heads * d, h),
              "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}
    experts = getattr(args, "num_experts", None)
    freq = getattr(args, "moe_layer_freq", 1)
    moe_layers = (sum(freq) if isinstance(freq, list) else len(range(0, args.num_layers, freq))) if experts else 0
    total = 0
    for linear, projection in settings.targets:
        layers = args.num_layers - (moe_layers if linear.startswith("mlp.") else 0)
        fan_in, fan_out = shapes[projection]
        a, b = (fan_in, fan_out / tp) if linear in COLUMN_PARALLEL else (fan_in / tp, fan_out)
        total += layers * settings.r * (a + b)
    return int(total)


def target_problem(args) -> Optional[str]:
    """Why the model the flags describe has no linear for some of ``--lora-target-modules`` (None when it has), so
    that the parser, hence ``--dry-run``, refuses what building the model would (:func:`adapt_layer_spec`)."""
    settings = settings_from_args(args)
    if settings is None:
        return None
    experts = getattr(args, "num_experts", None)
    freq = getattr(args, "moe_layer_freq", 1)
    moe_layers = (sum(freq) if isinstance(freq, list) else len(range(0, args.num_layers, freq))) if experts else 0
    dense_mlp = moe_layers < args.num_layers
    if not any(dense_mlp or not linear.startswith("mlp.") for linear, _ in settings.targets):
        return ("--lora-target-modules: none of the targeted linears exists in this model's layers (the MLPs of MoE "
                "layers get no adapter); add linear_qkv or linear_proj")
    if dense_mlp and settings.projections("mlp.linear_fc1") and not getattr(args, "swiglu", False):
        return ("--lora-target-modules: LoRA on linear_fc1 of a model without a gated MLP (--swiglu): it has no "
                "gate_proj and up_proj; adapt linear_qkv linear_proj linear_fc2 instead")
    return None


def idle_targets(args) -> list:
    """The ``--lora-target-modules`` names that adapt nothing in the model the flags describe: MLP names (megatron's or
    Hugging Face's) when every layer is MoE, whose experts get no adapter (``all-linear`` means what exists)."""
    settings = settings_from_args(args)
    if settings is None or not getattr(args, "num_experts", None):
        return []
    from mindspeed_pack.model.moe import moe_layer_pattern

    if not all(moe_layer_pattern(args)):
        return []
    return [name for name in target_names(args.lora_target_modules or []) if name != ALL_LINEAR
            and all(linear.startswith("mlp.") for linear, _ in resolve_targets([name]))]


def without_lora(args):
    """A copy of ``args`` that builds the model without adapters (a DPO ``--ref-load`` reference)."""
    plain = copy.copy(args)
    plain.lora_r = None
    return plain


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


# parameters a LoRA run trains in full beside the adapters (PEFT's modules_to_save), by the module PEFT names:
# a reward model's score head, which no adapter can stand for (a model without one has no such parameter)
TRAINED_IN_FULL = {SCORE: "score"}


def is_trained_name(name: str) -> bool:
    """What a LoRA run trains, saves and exports: its adapters and the parameters of :data:`TRAINED_IN_FULL`."""
    return is_adapter_name(name) or name in TRAINED_IN_FULL


def holds_adapters(state: dict) -> bool:
    return any(is_adapter_name(k) for k in state)


# --------------------------------------------------------------------------- the adapted linear
class _LoRALinear:
    """Mixed in before a megatron / TE linear class: the base output plus the adapters' (see module doc)."""

    def __init__(self, input_size: int, output_size: int, *, config, lora: LoRASettings, linear: str, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        tp = ps.get_tensor_model_parallel_world_size()
        self.lora_column = linear in COLUMN_PARALLEL
        self.lora_sequence_parallel = bool(config.sequence_parallel) and tp > 1
        self.lora_scale = lora.scale
        self.lora_r = lora.r
        self.lora_enabled = True
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else None
        self.lora_parts = lora.projections(linear)
        # the base's output layout: [groups, width of each projection] (QKV per query group, else one group)
        self.lora_groups, self.lora_layout = _output_layout(linear, output_size, config, tp)
        in_local = input_size if self.lora_column else input_size // tp
        dtype = config.params_dtype
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        widths = dict(self.lora_layout)
        for p in self.lora_parts:
            a = torch.nn.Parameter(torch.empty(lora.r, in_local, dtype=dtype))
            bound = 1.0 / math.sqrt(input_size)  # PEFT's kaiming_uniform(a=sqrt(5)); the trainer redraws it
            torch.nn.init.uniform_(a, -bound, bound)  # the same at every layout (init_weights.py)
            b = torch.nn.Parameter(torch.zeros(widths[p] if self.lora_column else output_size, lora.r, dtype=dtype))
            split, replicated = (b, a) if self.lora_column else (a, b)
            set_tensor_model_parallel_attributes(split, True, 0 if self.lora_column else 1, 1)
            # under sequence parallelism its gradient comes from this rank's sequence shard only: summed over TP
            # by finalize_model_grads, as megatron does for the norms
            setattr(replicated, "sequence_parallel", self.lora_sequence_parallel)
            self.lora_A[p], self.lora_B[p] = a, b

    def forward(self, x, *args, **kwargs):
        out, bias = super().forward(x, *args, **kwargs)
        if self.lora_enabled and self.lora_parts:
            out = out + self._lora_delta(x).to(out.dtype)
        return out, bias

    def _lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_dropout is not None and self.training:
            # one mask per projection, as PEFT draws for the separate q/k/v (gate/up) modules: each A sees its own
            # dropped input (a mask shared by the fused projections would correlate their updates)
            # x is the same on every TP rank: so are its masks (default generator); else each rank holds other elements
            column = self.lora_column and not self.lora_sequence_parallel
            with contextlib.nullcontext() if column else get_cuda_rng_tracker().fork():
                hs = [_matmul_2d(self.lora_dropout(x), self.lora_A[p]) for p in self.lora_parts]
            h = torch.cat(hs, dim=-1) if len(hs) > 1 else hs[0]
        else:  # no dropout: the projections' A in one matmul
            a = torch.cat([self.lora_A[p] for p in self.lora_parts]) if len(self.lora_parts) > 1 else \
                self.lora_A[self.lora_parts[0]]
            h = _matmul_2d(x, a)
        group = ps.get_tensor_model_parallel_group()
        if self.lora_column:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group) \
                if self.lora_sequence_parallel else copy_to_tensor_model_parallel_region(h, group=group)
        else:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group) if self.lora_sequence_parallel else \
                reduce_from_tensor_model_parallel_region(h, group=group)
        r = self.lora_r
        ys = {p: _matmul_2d(h[..., i * r:(i + 1) * r], self.lora_B[p]) for i, p in enumerate(self.lora_parts)}
        return self._fused(ys, h) * self.lora_scale

    def _fused(self, ys: dict, h: torch.Tensor) -> torch.Tensor:
        """Per-projection outputs in the base's fused layout (zeros for a projection without adapter)."""
        if len(self.lora_layout) == 1:
            return next(iter(ys.values()))
        lead, g = h.shape[:-1], self.lora_groups
        pieces = [(ys[p] if p in ys else h.new_zeros(*lead, w)).reshape(*lead, g, w // g) for p, w in self.lora_layout]
        return torch.cat(pieces, dim=-1).reshape(*lead, -1)


def _matmul_2d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as one 2-D matmul whatever the grad mode. ``torch.matmul`` folds a 3-D input into one ``mm``
    only when the weight requires grad, else batches it: a recomputed forward (no grad) took another kernel than
    the first, and LoRA gradients differed in their last bits with and without activation recomputation."""
    return torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])


def _output_layout(linear: str, output_size: int, config, tp: int):
    """(groups, [(projection, local rows)]) of a linear's output on one TP rank."""
    if linear == "self_attention.linear_qkv":
        d = config.kv_channels
        groups = config.num_query_groups // tp
        return groups, [("q_proj", config.num_attention_heads // tp * d), ("k_proj", groups * d),
                        ("v_proj", groups * d)]
    if linear == "mlp.linear_fc1":
        if not config.gated_linear_unit:
            raise ValueError("LoRA on linear_fc1 of a model without a gated MLP (--swiglu): it has no gate_proj "
                             "and up_proj; adapt linear_qkv linear_proj linear_fc2 instead")
        half = output_size // tp // 2
        return 1, [("gate_proj", half), ("up_proj", half)]
    parts = ADAPTED_LINEARS[linear]
    return 1, [(parts[0], output_size // tp if linear in COLUMN_PARALLEL else output_size)]


@functools.lru_cache(maxsize=None)
def lora_class(base: type) -> type:
    """``base`` with adapters (one class per base: megatron's local linears, TE's)."""
    return type(f"LoRA{base.__name__}", (_LoRALinear, base), {"__doc__": f"{base.__name__} with LoRA adapters."})


# --------------------------------------------------------------------------- the layer spec
def adapt_layer_spec(spec, settings: LoRASettings):
    """A copy of a layer spec (or a block spec's layers) whose targeted linears carry adapters.

    The MLPs of MoE layers (experts) are left as they are: their adapters would not map to one
    HF projection each. TE's fused layer-norm + linear is split into TE's norm and linear, so the
    adapters see the normalised input.
    """
    spec = copy.deepcopy(spec)
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    layers = list({id(layer): layer for layer in layers}.values())  # a block repeats one spec object
    adapted = 0
    for layer in layers:
        sub = layer.submodules
        for linear in ADAPTED_LINEARS:
            if not settings.projections(linear):
                continue
            owner_name, slot = linear.split(".")
            owner = getattr(sub, owner_name).submodules
            if not hasattr(owner, slot):  # an MoE layer's MLP (router + experts)
                continue
            base = getattr(owner, slot)
            base_cls = base.module if isinstance(base, ModuleSpec) else base
            if base_cls.__name__ == "TELayerNormColumnParallelLinear":
                from mindspeed_pack.model.te_spec import te_unfused_norm_and_linear

                norm, base_cls = te_unfused_norm_and_linear()
                setattr(sub, "input_layernorm" if owner_name == "self_attention" else "pre_mlp_layernorm", norm)
            params = dict(base.params) if isinstance(base, ModuleSpec) else {}
            setattr(owner, slot, ModuleSpec(module=lora_class(base_cls), params={**params, "lora": settings,
                                                                                    "linear": linear}))
            adapted += 1
    if not adapted:
        raise ValueError("--lora-target-modules: none of the targeted linears exists in this model's layers "
                         "(the MLPs of MoE layers get no adapter)")
    return spec


def freeze_base(model: torch.nn.Module) -> None:
    """Only the adapters (and a reward model's score head) train."""
    for name, p in model.named_parameters():
        p.requires_grad_(is_trained_name(name))


def lora_modules(model_chunks):
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, _LoRALinear):
                yield module


@contextlib.contextmanager
def base_model_only(model_chunks):
    """The base model in eval mode: the adapters switched off (a DPO reference without a second model)."""
    modules = list(lora_modules(model_chunks))
    training = [c.training for c in model_chunks]
    for m in modules:
        m.lora_enabled = False
    for c in model_chunks:
        c.eval()
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True
        for c, was in zip(model_chunks, training):
            c.train(was)


def checkpoint_entries(args, model_state: dict) -> dict:
    """What a LoRA run's checkpoint holds instead of the whole model: the adapters (and a reward model's score
    head), their settings and the base they were trained on (path and content fingerprint, ``args.lora_base``).
    Empty without LoRA."""
    settings = settings_from_args(args)
    if settings is None:
        return {}
    return {"model": {k: v for k, v in model_state.items() if is_trained_name(k)},
            "lora": {**settings.record(), "base": getattr(args, "lora_base", None)}}
