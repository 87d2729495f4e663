"""megatron-core's column- and row-parallel linears with two fixes for the packed, compiled hot path.

- **The row-parallel linear's group.** megatron-core 0.16.1's ``RowParallelLinear.forward`` calls
  ``linear_with_grad_accumulation_and_async_allreduce`` with ``tp_group=None``, and that function looks the
  default group up with a ``warnings.warn`` call (a DeprecationWarning, on rank 0) every time: host time in
  every layer of every micro-batch, and a graph break wherever a whole layer is compiled
  (``--torch-compile-kernels layers``: ``warnings.warn`` cannot be traced). The row-parallel linear
  communicates nothing inside that function (no dgrad all-reduce, no sequence-parallel gather), so which group
  it is handed changes nothing computed.
- **Traceable inside a compiled layer.** megatron-core's linear function starts asynchronous collectives in
  its backward and sets attributes of the weight, which dynamo cannot trace. A linear that
  :mod:`.compiled_layers` marks (``traced``) runs :func:`~.traced_linear.traced_linear` instead: the same
  product, communication and weight-gradient accumulation, in a form dynamo traces.
"""
from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear as _MegatronColumnParallelLinear
from megatron.core.tensor_parallel.layers import RowParallelLinear as _MegatronRowParallelLinear

from mindspeed_pack.model.traced_linear import traced_linear


class _Traceable:
    """Routes a marked linear's product through :func:`~.traced_linear.traced_linear` (megatron-core calls
    ``_forward_impl`` with keywords only)."""

    traced = False  # set by compiled_layers.compile_layers

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        if self.traced and not args and kwargs.get("grad_output_buffer") is None:
            return traced_linear(input, weight, kwargs.get("bias"),
                                 gradient_accumulation_fusion=kwargs.get("gradient_accumulation_fusion", False),
                                 allreduce_dgrad=kwargs.get("allreduce_dgrad", False),
                                 sequence_parallel=kwargs.get("sequence_parallel", False),
                                 tp_group=kwargs["tp_group"])
        return super()._forward_impl(input, weight, *args, **kwargs)


class ColumnParallelLinear(_Traceable, _MegatronColumnParallelLinear):
    """``ColumnParallelLinear``, traceable inside a compiled layer."""


class RowParallelLinear(_Traceable, _MegatronRowParallelLinear):
    """``RowParallelLinear`` passing ``self.tp_group`` where megatron-core passes None; traceable inside a
    compiled layer."""


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


def traceable_linears(module) -> list:
    """Our linears in ``module``."""
    return [m for m in module.modules() if isinstance(m, _Traceable)]
