#!/usr/bin/env bash
# What the engine adds, on the reference workload, for every strategy, eager and CUDA-graphed:
# `python -m trainer` against two references over the same loader (`trainer.overhead --reference both`):
#   plain  a plain loop running the engine's own step (`trainer.tools.plain_loop`);
#   hand   the loop a user writes: zero_grad, loss, backward, step, and under a CUDA graph a graph
#          captured by hand as PyTorch's docs show.
#   bash benchmarks/overhead.sh                    # every part at full length (one reference took 20 minutes on an H100)
#   bash benchmarks/overhead.sh --quick            # fewer steps and one repeat (over 9 minutes on an H100)
#   bash benchmarks/overhead.sh --quick --part eager   # one part: dataloader, eager, gather or graphed
#   bash benchmarks/overhead.sh --repeats 2        # extra arguments go to every python -m trainer.overhead
# The parts: `dataloader` (baseline, pinned, prefetch, iterable_chunks; eager and graphed), `eager`
# (pinned_chunk, gpu_resident, pinned_gather, pinned_uva), `gather` (graphed pinned_gather) and
# `graphed` (graphed pinned_chunk, gpu_resident, pinned_uva). Where a command's time is limited,
# run the parts one at a time: the last step joins whichever parts' tables exist.
# Host-bound variants (every eager step; the DataLoader strategies and pinned_gather, graphed too)
# take turns (--method turns, trainer.tools.turns); the GPU-bound graphed variants run in pairs.
# Writes each part's table to outputs/overhead[_quick]_<part>.md and the parts found to
# outputs/overhead[_quick].md (the "engine vs plain loop" table of docs/benchmark.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
out=outputs/overhead part=all
steps_dataloader=2500 steps_eager=8000 steps_gather=6000 gather_repeats=2 pair_repeats=2
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) out=outputs/overhead_quick
             steps_dataloader=800 steps_eager=2000 steps_gather=2000 gather_repeats=1 pair_repeats=1; shift ;;
    --part) part=${2:?"--part needs one of: dataloader eager gather graphed"}; shift 2 ;;
    *) break ;;
  esac
done
case "$part" in all|dataloader|eager|gather|graphed) ;;
  *) echo "error: --part $part is not a part: use one of dataloader, eager, gather, graphed" >&2; exit 2 ;;
esac
workload=(experiment=bench_strategies engine.device=cuda)
both=(--reference both)
wanted() { [ "$part" = all ] || [ "$part" = "$1" ]; }
if wanted dataloader; then
  python -m trainer.overhead "${both[@]}" --method turns --repeats 1 --graph both --loaders baseline,pinned,prefetch,iterable_chunks \
    --markdown "${out}_dataloader.md" "$@" "${workload[@]}" engine.max_steps=$steps_dataloader
fi
if wanted eager; then
  python -m trainer.overhead "${both[@]}" --method turns --repeats 1 --graph eager --loaders pinned_chunk,gpu_resident,pinned_gather,pinned_uva \
    --markdown "${out}_eager.md" "$@" "${workload[@]}" engine.max_steps=$steps_eager
fi
if wanted gather; then
  python -m trainer.overhead "${both[@]}" --method turns --repeats $gather_repeats --graph graphed --loaders pinned_gather \
    --markdown "${out}_gather.md" "$@" "${workload[@]}" engine.max_steps=$steps_gather
fi
if wanted graphed; then
  python -m trainer.overhead "${both[@]}" --method pairs --repeats $pair_repeats --graph graphed --loaders pinned_chunk,gpu_resident,pinned_uva \
    --markdown "${out}_graphed.md" "$@" "${workload[@]}" engine.max_steps=1050
fi
# One table from the parts' files that exist (a part run earlier on its own counts too).
first=1
for p in dataloader eager gather graphed; do
  [ -f "${out}_$p.md" ] || continue
  if [ $first = 1 ]; then cat "${out}_$p.md"; first=0; else tail -n +3 "${out}_$p.md"; fi
done > "$out.md"
cat "$out.md"
