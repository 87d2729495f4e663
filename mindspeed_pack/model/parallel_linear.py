"""megatron-core's column- and row-parallel linears with two fixes for the packed, compiled hot path.

- **The row-parallel linear's group.** megatron-core 0.16.1's ``RowParallelLinear.forward`` calls
  ``linear_with_grad_accumulation_and_async_allreduce`` with ``tp_group=None``, and that function looks the
  default group up with a ``warnings.warn`` call (a DeprecationWarning, on rank 0) every time: host time in
  every layer of every micro-batch, and a graph break wherever a whole layer is compiled
  (``--torch-compile-kernels layers``: ``warnings.warn`` cannot be traced). The row-parallel linear
  communicates nothing inside that function (no dgrad all-reduce, no sequence-parallel gather), so which group
  it is handed changes nothing computed.
- **Weight gradients accumulated inside a compiled layer.** megatron-core's fused accumulation sets attributes
  of the weight in its backward, which dynamo cannot trace. A linear that :mod:`.compiled_layers` marks
  (``accumulate_in_graph``) runs :func:`~.wgrad_fusion.traced_linear` instead: the same product, its weight
  gradient added into ``main_grad`` by a traceable operation.
"""
from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear as _MegatronColumnParallelLinear
from megatron.core.tensor_parallel.layers import RowParallelLinear as _MegatronRowParallelLinear

from mindspeed_pack.model import wgrad_fusion


class _InGraphAccumulation:
    """Routes a marked linear's product through :func:`~.wgrad_fusion.traced_linear` where it applies: the
    fused accumulation asked for, a trained weight with its ``main_grad``, nothing communicated."""

    accumulate_in_graph = False  # set by compiled_layers.compile_layers

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        if (self.accumulate_in_graph and kwargs.get("gradient_accumulation_fusion") and weight.requires_grad
                and hasattr(weight, "main_grad") and not kwargs.get("allreduce_dgrad")
                and not kwargs.get("sequence_parallel") and kwargs.get("grad_output_buffer") is None):
            return wgrad_fusion.traced_linear(input, weight, kwargs.get("bias"))
        return super()._forward_impl(input, weight, *args, **kwargs)


class ColumnParallelLinear(_InGraphAccumulation, _MegatronColumnParallelLinear):
    """``ColumnParallelLinear`` whose weight gradient can accumulate inside a compiled layer."""


class RowParallelLinear(_InGraphAccumulation, _MegatronRowParallelLinear):
    """``RowParallelLinear`` passing ``self.tp_group`` where megatron-core passes None; its weight gradient can
    accumulate inside a compiled layer."""


OWN = {_MegatronColumnParallelLinear: ColumnParallelLinear, _MegatronRowParallelLinear: RowParallelLinear}


def own_linears(submodules) -> None:
    """Replace megatron-core's column- and row-parallel linears by ours in a (nested) spec's submodules."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    for name, value in vars(submodules).items():
        if isinstance(value, type) and value in OWN:
            setattr(submodules, name, OWN[value])
        elif isinstance(value, ModuleSpec):
            if isinstance(value.module, type) and value.module in OWN:
                value.module = OWN[value.module]
            if value.submodules is not None:
                own_linears(value.submodules)


def in_graph_linears(module):
    """The linears in ``module`` whose weight gradient can accumulate inside a compiled graph."""
    return [m for m in module.modules() if isinstance(m, _InGraphAccumulation)
            and getattr(m, "gradient_accumulation_fusion", False) and m.weight is not None]
