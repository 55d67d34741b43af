#!/usr/bin/env bash
# What the engine adds: `python -m trainer` against a plain loop over the same loader, for every
# strategy, eager and CUDA-graphed, on seed 000's workload.
#   bash benchmarks/overhead.sh              # about 20 minutes on one H100
#   bash benchmarks/overhead.sh --repeats 2  # extra arguments go to every python -m trainer.overhead
# Host-bound variants (every eager step; the DataLoader strategies and pinned_gather, graphed too)
# take turns (--method turns, trainer.tools.turns); the two GPU-bound graphed variants run in pairs.
# Writes the table to outputs/overhead.md (the "engine vs plain loop" table of docs/benchmark.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
seed0=(experiment=bench_seed0 engine.device=cuda)
python -m trainer.overhead --method turns --repeats 1 --graph both --loaders baseline,pinned,prefetch \
  --markdown outputs/overhead_dataloader.md "$@" "${seed0[@]}" engine.max_steps=2500
python -m trainer.overhead --method turns --repeats 1 --graph eager --loaders pinned_chunk,gpu_resident,pinned_gather \
  --markdown outputs/overhead_eager.md "$@" "${seed0[@]}" engine.max_steps=8000
python -m trainer.overhead --method turns --repeats 2 --graph graphed --loaders pinned_gather \
  --markdown outputs/overhead_gather.md "$@" "${seed0[@]}" engine.max_steps=6000
python -m trainer.overhead --method pairs --repeats 2 --graph graphed --loaders pinned_chunk,gpu_resident \
  --markdown outputs/overhead_graphed.md "$@" "${seed0[@]}" engine.max_steps=1050
{ cat outputs/overhead_dataloader.md; tail -n +3 outputs/overhead_eager.md; tail -n +3 outputs/overhead_gather.md
  tail -n +3 outputs/overhead_graphed.md; } > outputs/overhead.md
cat outputs/overhead.md
