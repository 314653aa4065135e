#!/bin/bash
# One node of a trl-es run under SLURM (`srun` starts it once per node: examples/slurm/es.sbatch). The machine rank
# and the main process's address come from SLURM's variables; the rest is the multi-node recipe of docs/scaling.md.
#   RECIPE             the trl-es/TRL recipe (default examples/recipe.yaml); arguments after the script override it,
#                      `accelerate launch` flags among them (e.g. --mixed_precision no)
#   ACCELERATE_CONFIG  one of TRL's short names (multi_gpu, zero2, zero3, fsdp2, …) or a config file (default multi_gpu)
#   PROCESSES_PER_NODE processes on each node (default: the node's GPUs, SLURM_GPUS_ON_NODE)
#   MAIN_PORT          the main process's port on the first node (default 29500)
set -euo pipefail
main_address=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
per_node=${PROCESSES_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
exec trl-es es --config "${RECIPE:-examples/recipe.yaml}" --accelerate_config "${ACCELERATE_CONFIG:-multi_gpu}" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" --num_processes $((SLURM_NNODES * per_node)) \
    --main_process_ip "$main_address" --main_process_port "${MAIN_PORT:-29500}" "$@"
