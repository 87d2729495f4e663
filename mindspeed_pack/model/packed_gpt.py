"""megatron-core's ``GPTModel``, changed only where packed training pays for its generality.

* **RoPE by position, inside attention** (local and flash backends): megatron-core's unfused
  THD RoPE splits the tokens per segment with a ``.tolist()`` in every layer. Here the
  rotary table is gathered once per micro-batch at each token's position in its segment
  (:attr:`~.thd.ThdParams.rope_positions`, from the host) and the core attention rotates q and k
  (:func:`~.packed_rope.apply_packed_rope`), after the q/k norms as megatron-core does. Transformer Engine's
  spec keeps megatron-core's own (fused) RoPE.
* **The loss without full logits** (:mod:`.vocab_cross_entropy`) when labels are given and the micro-batch's
  fp32 logits would exceed their budget (:func:`~.vocab_cross_entropy.loss_chunk`); megatron-core's unfused
  loss, which does not compute the output layer twice, when they fit.
* **The weighted loss sum, its gradients formed in the forward** (``loss_weights``, SFT): given the fixed
  weight of each token's loss, the model returns ``sum_i w_i * loss_i`` (a scalar) instead of the per-token
  losses; the fused loss then forms its gradients while the logits exist
  (:func:`~.vocab_cross_entropy.linear_cross_entropy_sum`), and the unfused one sums its per-token losses.
* **A scalar head instead of the output layer** (``reward_head``, an outcome reward model): the
  vocab-parallel output layer is replaced by :class:`~.score_head.ScoreHead` on the last stage, and the
  model returns every token's reward ``[b, s]`` (with or without labels); embeddings are never tied to it.
* **The vocabulary-parallel embedding without boolean indexing** (TP > 1): megatron-core masks the
  tokens outside this rank's vocabulary shard with ``x[mask] = 0`` (a ``nonzero`` on a GPU: the host
  waits, once per micro-batch); here with ``where`` / ``masked_fill``, the same values and gradients.
* **Padded vocabulary rows out of the softmax**: the embedding holds ``--padded-vocab-size`` rows
  (a multiple of ``--make-vocab-size-divisible-by`` x TP) but only ``vocab_size`` are the model's;
  the others get no probability in every path (the fused loss: ``-inf`` logits; logits handed to a
  stage, for scored log-probs and entropies: the dtype's lowest finite value, so ``p log p`` stays 0),
  so a model loaded from Hugging Face gives transformers' numbers.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from mindspeed_pack.model.packed_rope import ROPE_TABLE
from mindspeed_pack.model.score_head import ScoreHead
from mindspeed_pack.model.thd import ThdParams
from mindspeed_pack.model.vocab_cross_entropy import linear_cross_entropy, linear_cross_entropy_sum, loss_chunk
from mindspeed_pack.model.vocab_parallel_loss import vocab_parallel_cross_entropy

log = logging.getLogger(__name__)


class MaskedVocabParallelEmbedding(VocabParallelEmbedding):
    """megatron-core's ``VocabParallelEmbedding`` with its out-of-shard masking done by ``where`` and
    ``masked_fill`` instead of boolean-mask assignment (which makes the host wait for the device)."""

    def forward(self, input_):
        if self.tp_group.size() == 1:
            return super().forward(input_)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = torch.where(outside, torch.zeros_like(input_), input_ - self.vocab_start_index)
        output = self.weight[local] if self.deterministic_mode else F.embedding(local, self.weight)
        output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:  # [b s h] -> [s b h], then scattered over the sequence
            return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous(),
                                                              group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


class PackedGPTModel(GPTModel):
    """``GPTModel`` for THD batches; see the module docstring. Extra keywords:

    ``rope_in_attention``: the core attention applies RoPE (local and flash backends);
    ``real_vocab_size``: the model's own vocabulary (rows past it are padding, masked);
    ``loss_chunk``: tokens per chunk of the fused output-layer loss (0 = megatron-core's unfused loss,
    ``None`` = chosen per micro-batch by :func:`~.vocab_cross_entropy.loss_chunk`);
    ``reward_head``: a scalar score head in place of the output layer (see the module docstring).
    """

    def __init__(self, *args, rope_in_attention: bool = False, real_vocab_size: Optional[int] = None,
                 loss_chunk: Optional[int] = None, reward_head: bool = False, **kwargs):
        if reward_head:
            kwargs["share_embeddings_and_output_weights"] = False  # the score head is a weight of its own
        super().__init__(*args, **kwargs)
        self.rope_in_attention = rope_in_attention and self.position_embedding_type == "rope"
        if self.rope_in_attention and self.config.rotary_interleaved:
            raise ValueError("interleaved RoPE is not supported by the packed attention backends")
        self.real_vocab_size = real_vocab_size if real_vocab_size and real_vocab_size < self.vocab_size else None
        self.loss_chunk = loss_chunk
        self._loss_weights = None  # set for one forward by ``forward(loss_weights=...)``
        if self.pre_process and type(self.embedding.word_embeddings) is VocabParallelEmbedding:
            self.embedding.word_embeddings.__class__ = MaskedVocabParallelEmbedding
        self.score = None
        if reward_head and self.post_process:
            del self.output_layer  # built by GPTModel; a reward model has no vocabulary output
            self.output_layer = None
            self.score = ScoreHead(self.config, self.pg_collection.tp)
        if self.post_process and self.real_vocab_size and self.score is None:
            self.output_layer.register_forward_hook(self._mask_padded_vocab)
            log.info("vocabulary: %d rows, padded to %d (--make-vocab-size-divisible-by x TP); the %d padded rows are "
                     "masked out of the softmax, so losses and log-probs are those of the %d-row model",
                     self.real_vocab_size, self.vocab_size, self.vocab_size - self.real_vocab_size,
                     self.real_vocab_size)

    def forward(self, *args, loss_weights: Optional[torch.Tensor] = None, **kwargs):
        """``GPTModel.forward``; ``loss_weights`` [b, s] (with ``labels``, on the last stage): return the weighted
        sum of the token losses, a scalar, instead of the per-token losses (see the module docstring)."""
        self._loss_weights = loss_weights
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._loss_weights = None

    # ------------------------------------------------------------------ RoPE
    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context, packed_seq_params,
                                  *args, **kwargs)
        hidden = out[0]
        if (self.config.recompute_granularity == "full" and torch.is_grad_enabled()
                and isinstance(hidden, torch.Tensor) and not hidden.requires_grad):
            # megatron-core's recomputation is an autograd function of the layers' tensor inputs only: from a
            # frozen embedding (LoRA) its output would need no gradient, and the layers' adapters would get none
            hidden.requires_grad_()
        rotary = out[1]
        if (self.rope_in_attention and rotary is not None and isinstance(packed_seq_params, ThdParams)
                and packed_seq_params.rope_positions is not None):
            packed_seq_params.__dict__[ROPE_TABLE] = rotary
            out = (out[0], None, *out[2:])
        return out

    # ------------------------------------------------------------------ vocabulary
    def _vocab_range(self, width: int) -> tuple:
        """(first global row, rows) of logits ``width`` wide: this TP rank's shard, or the gathered whole."""
        if width == self.vocab_size:
            return 0, width
        return ps.get_tensor_model_parallel_rank() * width, width

    def _mask_padded_vocab(self, module, inputs, output):
        logits, bias = output
        if self.real_vocab_size is None:
            return output
        start, width = self._vocab_range(logits.shape[-1])
        first_pad = self.real_vocab_size - start
        if first_pad < width:
            logits = logits.clone()
            logits[..., max(0, first_pad):] = torch.finfo(logits.dtype).min
        return logits, bias

    # ------------------------------------------------------------------ loss
    def compute_language_model_loss(self, labels, logits):
        """megatron-core's unfused loss, its out-of-shard targets masked without boolean indexing
        (:mod:`.vocab_parallel_loss`); megatron-core's own with its fused cross-entropy kernels."""
        if self.config.cross_entropy_loss_fusion:
            return super().compute_language_model_loss(labels, logits)
        start, _ = self._vocab_range(logits.shape[-1])
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), start, self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s]

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if self.score is not None and self.post_process:
            return self.score(hidden_states).transpose(0, 1).contiguous()  # [b, s] rewards, labels or not
        fused = (self.post_process and labels is not None and self.loss_chunk != 0
                 and not self.config.mtp_num_layers and not kwargs.get("mtp_in_postprocess")
                 and kwargs.get("inference_context") is None)
        if fused:
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else self.output_layer.weight
            tp_group = self.pg_collection.tp
            # the tokens this rank's output layer sees (sequence parallelism gathers them first)
            tokens = hidden_states.shape[0] * hidden_states.shape[1] * \
                (tp_group.size() if self.config.sequence_parallel else 1)
            chunk = loss_chunk(tokens, weight.shape[0], self.loss_chunk)
            fused = chunk != 0
        loss_weights = self._loss_weights if labels is not None and self.post_process else None
        if not fused:
            out = super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
            return out if loss_weights is None else (out.float() * loss_weights.reshape(out.shape)).sum()
        if self.config.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, True, group=tp_group)
        elif tp_group.size() > 1:
            hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=tp_group)
        s, b, h = hidden_states.shape
        start, _ = self._vocab_range(weight.shape[0])
        if loss_weights is not None:
            return linear_cross_entropy_sum(hidden_states.reshape(s * b, h), weight, labels.transpose(0, 1).reshape(-1),
                                            loss_weights.reshape(labels.shape).transpose(0, 1).reshape(-1),
                                            vocab_start=start,
                                            vocab_limit=self.real_vocab_size, chunk=chunk, group=tp_group)[0]
        loss = linear_cross_entropy(hidden_states.reshape(s * b, h), weight, labels.transpose(0, 1).reshape(-1),
                                    vocab_start=start, vocab_limit=self.real_vocab_size, chunk=chunk,
                                    group=tp_group)
        return loss.view(s, b).transpose(0, 1).contiguous()  # [b, s], as compute_language_model_loss returns
