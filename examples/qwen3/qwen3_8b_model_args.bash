# Qwen3-8B architecture (config.json of the HF checkpoint), sourced by tune_qwen3_8b_4k_full_pack.sh
# (MODEL_ARGS_FILE of examples/qwen25/tune_qwen25_7b_4k_full_pack.sh). SEQ_LEN is the script's.
# shellcheck disable=SC2034
MODEL_ARGS=(
    --num-layers 36
    --hidden-size 4096
    --ffn-hidden-size 12288
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128              # head_dim (config.json): Qwen3-0.6B/4B/32B have head_dim != hidden/heads
    --qk-layernorm                 # per-head RMSNorm on q and k; their gradients are summed over TP
    --disable-bias-linear          # Qwen3 has no bias on any linear layer (no --add-qkv-bias)
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 1000000
    --max-position-embeddings 40960
    --untie-embeddings-and-output-weights   # 8B is untied (0.6B-4B tie: drop this flag there)
    --padded-vocab-size 151936     # the HF embedding's row count, so converted weights fit exactly
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
