"""The model: megatron-core's GPTModel with packed (THD) attention chosen in the layer spec (local,
flash varlen or Transformer Engine), RoPE per segment, context-parallel attention, the fused vocabulary
cross-entropy, mixture-of-experts routing by sample, and LoRA adapters on the parallel linears.

May import ``packing`` and ``runtime`` only.
"""
