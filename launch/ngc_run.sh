#!/usr/bin/env bash
# Run a command inside the megatron-alp GPU container (built from the Dockerfile, on the NGC
# PyTorch image) with the flags NVIDIA recommends for PyTorch containers, the repository mounted
# at its own path (its code is used, through PYTHONPATH, so edits need no rebuild), and the
# model/data folders mounted where the configs expect them.
#
#   docker build -t megatron-alp:gpu .
#   bash launch/ngc_run.sh configs/qwen2.5-math-1.5b_token_alp.yaml [KEY=VALUE ...]   # training
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash launch/ngc_run.sh configs/qwen2.5-32b_seq_alp.yaml
#   bash launch/ngc_run.sh megatron-alp eval configs/qwen2.5-math-1.5b_token_alp.yaml   # any command
#   bash launch/ngc_run.sh                                                         # interactive shell
# A YAML file as first argument runs launch/torchrun_multinode.sh with it (one node of the job).
#
# Environment (defaults in brackets):
#   IMAGE [megatron-alp:gpu]   MODELS_DIR [/models]   DATA_DIR [/data]   GPUS [all]
#   DOCKER [docker]            DRY_RUN=1 print the docker command instead of running it
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE, NPROC_PER_NODE, HF_TOKEN, WANDB_API_KEY and NCCL_*
# are passed into the container when set. Host networking lets NCCL and torchrun reach other nodes.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
IMAGE=${IMAGE:-megatron-alp:gpu}
MODELS_DIR=${MODELS_DIR:-/models}
DATA_DIR=${DATA_DIR:-/data}
GPUS=${GPUS:-all}
DOCKER=${DOCKER:-docker}
# Relative paths keep working inside: the container starts in the same directory when it is in the repo.
case "$PWD/" in "$REPO"/*) WORKDIR=$PWD ;; *) WORKDIR=$REPO ;; esac

args=(run --rm --gpus "$GPUS" --ipc=host --network=host
      --ulimit memlock=-1 --ulimit stack=67108864 --shm-size=64g
      -v "$REPO:$REPO" -w "$WORKDIR" -e PYTHONPATH="$REPO")
for dir in "$MODELS_DIR:/models" "$DATA_DIR:/data"; do
  if [ -d "${dir%%:*}" ]; then
    args+=(-v "$dir")
  else
    echo "note: ${dir%%:*} does not exist on this host; not mounting it at ${dir##*:}" >&2
  fi
done
for var in NNODES NODE_RANK MASTER_ADDR MASTER_PORT GPUS_PER_NODE NPROC_PER_NODE HF_TOKEN WANDB_API_KEY $(compgen -e | grep '^NCCL_' || true); do
  if [ -n "${!var:-}" ]; then args+=(-e "$var"); fi
done
if [ -t 0 ] && [ -t 1 ]; then
  args+=(-it)
fi
if [ $# -eq 0 ]; then
  set -- bash
elif [[ $1 == *.yaml || $1 == *.yml ]]; then
  [ -f "$1" ] || { echo "error: config file $1 does not exist" >&2; exit 2; }
  set -- bash "$REPO/launch/torchrun_multinode.sh" "$@"
fi
cmd=("$DOCKER" "${args[@]}" "$IMAGE" "$@")

if [ "${DRY_RUN:-0}" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi
command -v "$DOCKER" >/dev/null || { echo "error: $DOCKER not found (install Docker with the NVIDIA container toolkit)" >&2; exit 2; }
exec "${cmd[@]}"
