#!/usr/bin/env bash
# The position sweep on a GPU machine: one process on one GPU, then one rank per GPU under
# torchrun (NCCL beside a gloo group), the same sweep; each prints one JSON line. Under 8
# minutes on one H100 with the default 1,000 examples. With one GPU, two ranks share it (a
# check that the ranks run, not a speed-up). EXAMPLES=200 for a shorter run.
set -euo pipefail
cd "$(dirname "$0")"
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
examples="${EXAMPLES:-1000}"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
ranks=$(( gpus > 1 ? gpus : 2 ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python position_sweep.py --device cuda --examples "$examples"
python -m torch.distributed.run --standalone --nproc-per-node "$ranks" \
    position_sweep.py --device cuda --examples "$examples"
