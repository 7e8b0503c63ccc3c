#!/bin/sh
# Starts the learner under torchrun: `sinkflex-learner [learner_service args...]`.
#
# The torchrun layout comes from the environment (static rendezvous, so that node 0 holds
# global rank 0, which reads the trajectory stream and serves the learner's gRPC API):
#   NNODES            nodes in the job                      (default 1)
#   NPROC_PER_NODE    processes (GPUs) per node             (default 1)
#   NODE_RANK         this node's rank; when unset or empty:
#                     POD_INDEX + NODE_RANK_OFFSET, where POD_INDEX is the StatefulSet
#                     ordinal (Kubernetes' apps.kubernetes.io/pod-index label, else the number
#                     at the end of the hostname, "sinkflex-learner-worker-1" -> 1, else 0)
#   NODE_RANK_OFFSET  added to POD_INDEX                    (default 0; the chart's worker
#                     StatefulSet sets 1: its pod 0 is node 1)
#   MASTER_ADDR       address of node 0                     (default 127.0.0.1)
#   MASTER_PORT       rendezvous port on node 0             (default 29500)
set -eu
if [ -z "${NODE_RANK:-}" ]; then
  index="${POD_INDEX:-}"
  if [ -z "$index" ]; then
    host="${HOSTNAME:-}"
    index="${host##*-}"
  fi
  case "$index" in
    ''|*[!0-9]*) index=0 ;;
  esac
  offset="${NODE_RANK_OFFSET:-0}"
  case "$offset" in
    ''|*[!0-9]*) echo "sinkflex-learner: NODE_RANK_OFFSET must be a number, got '$offset'" >&2; exit 2 ;;
  esac
  NODE_RANK=$((index + offset))
fi
exec torchrun \
  --nnodes "${NNODES:-1}" \
  --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --node-rank "${NODE_RANK}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" \
  --master-port "${MASTER_PORT:-29500}" \
  -m learner_service "$@"
