#!/bin/bash
# One node's share of a multi-node run: `accelerate launch` with this node's rank and the main
# node's address. Under Slurm (train.sbatch) the values come from Slurm's environment; anywhere
# else set them yourself (tests/test_backends.py rehearses two nodes on 127.0.0.1 this way).
#   SLURM_NNODES  number of nodes            SLURM_NODEID  this node's rank (0 = main)
#   MAIN_ADDR     main node's address        MAIN_PORT     a free port on it
#   GPUS_PER_NODE processes per node         LAUNCH        accelerate YAML   RECIPE  recipe YAML
# Extra arguments are recipe overrides (e.g. resume=auto).
set -euo pipefail
: "${SLURM_NNODES:?}" "${SLURM_NODEID:?}" "${MAIN_ADDR:?}" "${MAIN_PORT:?}" "${GPUS_PER_NODE:?}" "${LAUNCH:?}" "${RECIPE:?}"
exec "${PYTHON:-python}" -m accelerate.commands.launch --config_file "$LAUNCH" \
  --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" \
  --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
  --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" --rdzv_backend static \
  -m toolkit train "$RECIPE" "$@"
