#!/usr/bin/env bash
# What the engine adds: `python -m trainer` against a plain loop over the same loader, for every
# strategy, eager and CUDA-graphed, on seed 000's workload, three alternating repeats each.
#   bash docs/overhead.sh              # 72 fresh processes of 15-40 s each: about 25 minutes on one H100
#   bash docs/overhead.sh --repeats 5  # extra arguments go to python -m trainer.overhead
# Writes the table to outputs/overhead.md (the "engine vs plain loop" table of docs/benchmark.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
python -m trainer.overhead --repeats 3 --graph both --markdown outputs/overhead.md \
  --loaders baseline,pinned,prefetch,pinned_chunk,pinned_gather,gpu_resident "$@" experiment=bench_seed0 engine.device=cuda
