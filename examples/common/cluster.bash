# The launch geometry every example training script shares, sourced after the script's own defaults.
# One value per node for NODE_RANK; MASTER_ADDR is the address of the node with NODE_RANK=0, reachable from
# all nodes (docs/multinode.md). Sets WORLD_SIZE and DISTRIBUTED_ARGS (torch.distributed.run's flags).
# shellcheck disable=SC2034
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)
