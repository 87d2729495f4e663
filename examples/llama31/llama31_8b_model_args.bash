# Llama-3.1-8B(-Instruct) architecture (config.json of the HF checkpoint), sourced by tune_llama31_8b_4k_full_pack.sh
# (MODEL_ARGS_FILE of examples/qwen25/tune_qwen25_7b_4k_full_pack.sh). SEQ_LEN is the script's.
# shellcheck disable=SC2034
MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --disable-bias-linear          # Llama has no bias on any linear layer (attention_bias, mlp_bias false)
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --position-embedding-type rope
    --rotary-base 500000
    --use-rope-scaling             # rope_scaling.rope_type llama3 (MindSpeed-LLM: --rope-scaling-type llama3)
    --rope-scaling-factor 8.0
    --low-freq-factor 1.0
    --high-freq-factor 4.0
    --original-max-position-embeddings 8192
    --max-position-embeddings 131072
    --untie-embeddings-and-output-weights   # 8B is untied (Llama-3.2-1B/3B tie: drop this flag there)
    --padded-vocab-size 128256     # the HF embedding's row count, so converted weights fit exactly
    --seq-length "$SEQ_LEN"
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
