# Qwen3-30B-A3B architecture (config.json of the HF checkpoint), sourced by tune_qwen3_30b_a3b_4k_full_pack.sh
# (MODEL_ARGS_FILE of examples/qwen25/tune_qwen25_7b_4k_full_pack.sh). SEQ_LEN is the script's.
# shellcheck disable=SC2034
MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144         # intermediate_size (dense layers; Qwen3-30B-A3B has none)
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128              # head_dim != hidden/heads (64)
    --qk-layernorm
    --disable-bias-linear
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 1000000
    --max-position-embeddings 40960
    --untie-embeddings-and-output-weights
    --padded-vocab-size 151936
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
    # mixture of experts: every layer (decoder_sparse_step 1, no mlp_only_layers)
    --num-experts 128
    --moe-router-topk 8
    --moe-ffn-hidden-size 768      # moe_intermediate_size
    --moe-layer-freq 1
    # norm_topk_prob true: top-8 weights renormalised (no --moe-router-pre-softmax)
    --moe-router-load-balancing-type aux_loss   # over the micro-batch's real tokens (pads excluded)
    --moe-aux-loss-coeff 0.001     # router_aux_loss_coef
    --moe-token-dispatcher-type alltoall
    --moe-grouped-gemm             # TE grouped GEMM for the experts on GPUs
)
