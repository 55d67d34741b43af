#!/usr/bin/env bash
# The multi_gpu preset on 1, 2 and 4 GPUs of this host (those it has), one torchrun launch per GPU
# count, then one scaling table of the latest launch of each:
#   bash benchmarks/multi_gpu.sh               # GPU counts 1 2 4
#   COUNTS="1 2" bash benchmarks/multi_gpu.sh  # only these
# Extra arguments go to every launch (e.g. engine.max_steps=200).
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
for n in ${COUNTS:-1 2 4}; do
  if [ "$n" -gt "$gpus" ]; then
    echo "skipping $n GPUs: this host has $gpus" >&2
    continue
  fi
  python -m torch.distributed.run --standalone --nproc_per_node="$n" -m trainer -m experiment=multi_gpu "$@"
done
python -m trainer.tools.scaling --experiment multi_gpu --markdown docs/results/multi_gpu.md
