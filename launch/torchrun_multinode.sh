#!/usr/bin/env bash
# Run `megatron-alp train CONFIG [KEY=VALUE ...]` with torchrun on NNODES nodes x GPUS_PER_NODE GPUs:
# one trainer rank per GPU, or, with rollout.placement: separate, one per GPU left after the
# config's rollout.gpus (the engines' GPUs of every node; the ranks take the first GPUs).
# Run the same command on every node, changing only NODE_RANK:
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/torchrun_multinode.sh configs/qwen2.5-32b_seq_alp.yaml
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash launch/torchrun_multinode.sh configs/qwen2.5-32b_seq_alp.yaml
#
# Environment (defaults in brackets):
#   NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1]  MASTER_PORT [29500]
#   GPUS_PER_NODE [number of GPUs nvidia-smi lists]   PYTHON [python]
#   NPROC_PER_NODE [GPUS_PER_NODE, less len(rollout.gpus) with rollout.placement: separate]: trainer
#     ranks per node (torchrun --nproc_per_node), read from the config and its KEY=VALUE overrides
#   DRY_RUN=1   print the command instead of running it
# SIGTERM or SIGUSR1 to this script (a cluster's preemption notice) goes to the trainer ranks, which
# stop after their current iteration with a checkpoint; the script then exits with the ranks' own
# code (torchrun reports any failed rank as 1): 75 stopped for preemption (run it again to resume),
# 124 a phase hung past trainer.hang_deadline_s, 130 Ctrl-C.
# The config's parallel layout must divide NNODES * NPROC_PER_NODE (the trainer checks and says so).
# Relative paths in the config (trainer.output_dir, data files) are relative to the current directory.
set -euo pipefail

usage="usage: [NNODES=N NODE_RANK=R MASTER_ADDR=HOST GPUS_PER_NODE=G] $0 CONFIG.yaml [KEY=VALUE ...]"
CONFIG=${1:?$usage}
shift
[ -f "$CONFIG" ] || { echo "error: config file $CONFIG does not exist" >&2; exit 2; }

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  [ "$GPUS_PER_NODE" -gt 0 ] || { echo "error: no GPU found by nvidia-smi; set GPUS_PER_NODE" >&2; exit 2; }
fi

for var in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE; do
  [[ ${!var} =~ ^[0-9]+$ ]] || { echo "error: $var must be a non-negative integer (got '${!var}')" >&2; exit 2; }
done
[ "$NNODES" -ge 1 ] && [ "$GPUS_PER_NODE" -ge 1 ] || { echo "error: NNODES and GPUS_PER_NODE must be >= 1" >&2; exit 2; }

if [ -z "${NPROC_PER_NODE:-}" ]; then  # the GPUs that rollout.gpus leaves to the trainer
  engine_gpus=$("$PYTHON" -c 'import sys
from megatron_alp.config import ConfigError
from megatron_alp.resolve import load_config
try:
    r = load_config(sys.argv[1], [a for a in sys.argv[2:] if "=" in a and not a.startswith("-")]).rollout
except ConfigError as err:
    sys.exit(f"error: {err}")
print(len(r.gpus) if r.placement == "separate" else 0)' "$CONFIG" "$@") \
    || { echo "error: could not read rollout.placement and rollout.gpus of $CONFIG with $PYTHON (or set NPROC_PER_NODE)" >&2; exit 2; }
  NPROC_PER_NODE=$((GPUS_PER_NODE - engine_gpus))
  [ "$NPROC_PER_NODE" -ge 1 ] || {
    echo "error: rollout.gpus takes $engine_gpus GPUs of each node: GPUS_PER_NODE=$GPUS_PER_NODE leaves none for the trainer" >&2
    exit 2
  }
fi
[[ $NPROC_PER_NODE =~ ^[0-9]+$ ]] && [ "$NPROC_PER_NODE" -ge 1 ] && [ "$NPROC_PER_NODE" -le "$GPUS_PER_NODE" ] || {
  echo "error: NPROC_PER_NODE must be a number of trainer ranks from 1 to GPUS_PER_NODE=$GPUS_PER_NODE (got '$NPROC_PER_NODE')" >&2
  exit 2
}
[ "$NODE_RANK" -lt "$NNODES" ] || { echo "error: NODE_RANK=$NODE_RANK must be below NNODES=$NNODES" >&2; exit 2; }
if [ "$NNODES" -gt 1 ] && [[ $MASTER_ADDR == 127.* || $MASTER_ADDR == localhost ]]; then
  echo "error: with NNODES=$NNODES set MASTER_ADDR to the address of the NODE_RANK=0 node" >&2
  exit 2
fi

# Megatron's tensor/sequence-parallel overlap relies on kernels running in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}

cmd=("$PYTHON" -m torch.distributed.run
     --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE"
     --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
     -m megatron_alp.cli train "$CONFIG" "$@")

echo "node $NODE_RANK/$NNODES, $GPUS_PER_NODE GPUs ($NPROC_PER_NODE trainer ranks), master $MASTER_ADDR:$MASTER_PORT" >&2
if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
MEGATRON_ALP_EXIT_FILE=$(mktemp "${TMPDIR:-/tmp}/megatron-alp-exit.XXXXXX")
export MEGATRON_ALP_EXIT_FILE
trap 'rm -f "$MEGATRON_ALP_EXIT_FILE"' EXIT
"${cmd[@]}" &
agent=$!
# torchrun's agent would die of SIGUSR1 and give its ranks 30 s after SIGTERM: the notice goes to
# the ranks (the agent's children) directly.
interrupted=0
forward() { interrupted=1; pkill "-$1" -P "$agent" || true; }
trap 'forward USR1' USR1
trap 'forward TERM' TERM
while true; do
  interrupted=0
  if wait "$agent"; then rc=0; else rc=$?; fi
  [ "$interrupted" = 1 ] || break  # a trapped signal ended the wait, not the agent: wait again
done
ranks=$(cat "$MEGATRON_ALP_EXIT_FILE" 2>/dev/null || true)
if [ "$rc" -ne 0 ] && [[ $ranks =~ ^[0-9]+$ ]] && [ "$ranks" -ne 0 ]; then
  exit "$ranks"
fi
exit "$rc"
