#!/bin/sh
# Starts the learner under torchrun: `sinkflex-learner [learner_service args...]`.
#
# The torchrun layout comes from the environment (static rendezvous, so that node 0 holds
# global rank 0, which serves the learner's gRPC API):
#   NNODES           nodes in the job                      (default 1)
#   NPROC_PER_NODE   processes (GPUs) per node             (default 1)
#   NODE_RANK        this node's rank; when unset, the ordinal at the end of the
#                    hostname (StatefulSet pod "sinkflex-learner-1" -> 1), else 0
#   MASTER_ADDR      address of node 0                     (default 127.0.0.1)
#   MASTER_PORT      rendezvous port on node 0             (default 29500)
set -eu
if [ -z "${NODE_RANK:-}" ]; then
  ordinal="${HOSTNAME##*-}"
  case "$ordinal" in
    ''|*[!0-9]*) NODE_RANK=0 ;;
    *) NODE_RANK="$ordinal" ;;
  esac
fi
exec torchrun \
  --nnodes "${NNODES:-1}" \
  --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --node-rank "${NODE_RANK}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  -m learner_service "$@"
