#!/usr/bin/env bash
# What the engine adds, on the reference workload, for every strategy, eager and CUDA-graphed:
# `python -m trainer` against two references over the same loader (`trainer.overhead --reference both`):
#   plain  a plain loop running the engine's own step (`trainer.tools.plain_loop`);
#   hand   the loop a user writes: zero_grad, loss, backward, step, and under a CUDA graph a graph
#          captured by hand as PyTorch's docs show.
#   bash benchmarks/overhead.sh              # every variant at full length (one reference took 20 minutes on an H100)
#   bash benchmarks/overhead.sh --quick      # the same variants with fewer steps and one repeat (meant to take about 8 minutes)
#   bash benchmarks/overhead.sh --repeats 2  # extra arguments go to every python -m trainer.overhead
# Host-bound variants (every eager step; the DataLoader strategies and pinned_gather, graphed too)
# take turns (--method turns, trainer.tools.turns); the two GPU-bound graphed variants run in pairs.
# Writes the table to outputs/overhead.md, or outputs/overhead_quick.md with --quick (the "engine vs
# plain loop" table of docs/benchmark.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
if [ "${1:-}" = "--quick" ]; then
  shift
  out=outputs/overhead_quick
  steps_dataloader=800 steps_eager=2000 steps_gather=2000 gather_repeats=1 pair_repeats=1
else
  out=outputs/overhead
  steps_dataloader=2500 steps_eager=8000 steps_gather=6000 gather_repeats=2 pair_repeats=2
fi
workload=(experiment=bench_strategies engine.device=cuda)
both=(--reference both)
python -m trainer.overhead "${both[@]}" --method turns --repeats 1 --graph both --loaders baseline,pinned,prefetch \
  --markdown "${out}_dataloader.md" "$@" "${workload[@]}" engine.max_steps=$steps_dataloader
python -m trainer.overhead "${both[@]}" --method turns --repeats 1 --graph eager --loaders pinned_chunk,gpu_resident,pinned_gather \
  --markdown "${out}_eager.md" "$@" "${workload[@]}" engine.max_steps=$steps_eager
python -m trainer.overhead "${both[@]}" --method turns --repeats $gather_repeats --graph graphed --loaders pinned_gather \
  --markdown "${out}_gather.md" "$@" "${workload[@]}" engine.max_steps=$steps_gather
python -m trainer.overhead "${both[@]}" --method pairs --repeats $pair_repeats --graph graphed --loaders pinned_chunk,gpu_resident \
  --markdown "${out}_graphed.md" "$@" "${workload[@]}" engine.max_steps=1050
{ cat "${out}_dataloader.md"; tail -n +3 "${out}_eager.md"; tail -n +3 "${out}_gather.md"
  tail -n +3 "${out}_graphed.md"; } > "$out.md"
cat "$out.md"
