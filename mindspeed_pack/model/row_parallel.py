"""megatron-core's ``RowParallelLinear`` that hands its own tensor-parallel group to the linear function.

megatron-core 0.16.1's ``RowParallelLinear.forward`` calls ``linear_with_grad_accumulation_and_async_allreduce``
with ``tp_group=None``, and that function looks the default group up with a ``warnings.warn`` call (a
DeprecationWarning, on rank 0) every time: host time in every layer of every micro-batch, and a graph break
wherever a whole layer is compiled (``--torch-compile-kernels layers``: ``warnings.warn`` cannot be traced).
The row-parallel linear communicates nothing inside that function (no dgrad all-reduce, no sequence-parallel
gather), so which group it is handed changes nothing computed.
"""
from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear as _MegatronRowParallelLinear


class RowParallelLinear(_MegatronRowParallelLinear):
    """``RowParallelLinear`` passing ``self.tp_group`` where megatron-core passes None."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def own_row_parallel(submodules) -> None:
    """Replace megatron-core's ``RowParallelLinear`` by :class:`RowParallelLinear` in a (nested) spec's submodules."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    for name, value in vars(submodules).items():
        if value is _MegatronRowParallelLinear:
            setattr(submodules, name, RowParallelLinear)
        elif isinstance(value, ModuleSpec):
            if value.module is _MegatronRowParallelLinear:
                value.module = RowParallelLinear
            if value.submodules is not None:
                own_row_parallel(value.submodules)
