"""The scalar head of an outcome reward model: hidden -> 1, no bias (transformers' ``score`` of
``*ForSequenceClassification`` with ``num_labels=1``), in place of the vocab-parallel output layer.

A 1-wide head cannot be split over tensor-parallel ranks: it is replicated, and every TP rank computes
the same per-token rewards. Without sequence parallelism each rank holds every token's hidden state:
its rewards, the loss and the head's gradient are the same on all TP ranks (no reduction; the gradient
norm counts the head once, as any replicated parameter). Under sequence parallelism each rank holds a
slice of the tokens: it scores its slice, the slices are gathered (the backward hands each rank its
slice's gradient back), and the head's gradient, partial per rank, is summed over the TP group by
``finalize_model_grads`` (``sequence_parallel`` set, as on the layer norms). It lives on the last
pipeline stage only.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

SCORE = "score.weight"  # the head's parameter name (transformers' too)


class ScoreHead(torch.nn.Module):
    """Per-token scalar rewards ``[s, b, h] -> [s, b]`` (all tokens, gathered under sequence parallelism)."""

    def __init__(self, config, tp_group):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)  # replicated over TP
        self.weight.sequence_parallel = config.sequence_parallel  # partial gradients: summed over TP

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rewards = torch.matmul(hidden_states, self.weight.t())
        if self.sequence_parallel:
            rewards = gather_from_sequence_parallel_region(rewards, tensor_parallel_output_grad=False,
                                                           group=self.tp_group)
        return rewards.squeeze(-1)
