# Qwen2.5-7B architecture (config.json of the HF checkpoint), sourced by the qwen25 tune_*.sh scripts. A flag
# that differs from a HF directory's config.json is refused at --load. SEQ_LEN is the script's.
# shellcheck disable=SC2034
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 3584
    --ffn-hidden-size 18944
    --num-attention-heads 28
    --group-query-attention
    --num-query-groups 4
    --add-qkv-bias                 # Qwen2 has biases on q/k/v only ...
    --disable-bias-linear          # ... and on no other linear layer
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --position-embedding-type rope
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --padded-vocab-size 152064     # the HF embedding's row count, so converted weights fit exactly
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
