#!/usr/bin/env bash
# What the engine adds, on the reference workload, for every registered strategy, eager and
# CUDA-graphed, against two references over the same loader (`trainer.overhead --reference both`):
#   plain  a plain loop running the engine's own step (`trainer.tools.plain_loop`);
#   hand   the loop a user writes: zero_grad, loss, backward, step, and under a CUDA graph a graph
#          captured by hand as PyTorch's docs show.
#
#   bash benchmarks/overhead.sh                  # the whole table in one command (295 s on an H200)
#   bash benchmarks/overhead.sh --rounds 8       # more rounds for the host-bound rows (about 8 minutes)
#   bash benchmarks/overhead.sh --limit-s 500    # its own time limit (default 330 s; the rows done are kept)
#   bash benchmarks/overhead.sh --processes [--quick] [--part dataloader|eager|gather|graphed]
#                                                # the same table from fresh processes, part by part
#                                                # (`--quick` took over 9 minutes on an H100)
# Extra arguments go to every `python -m trainer.overhead` call.
#
# The default runs `--method rounds`: three warm processes (the engine's `run()`, each reference's
# plain script) that build the dataset once; each row is `--rounds` rounds of one run per side,
# one process at a time, the side that goes first rotating. Its table is written to
# outputs/overhead.md row by row, so a run stopped at its limit keeps the rows it finished.
# `--processes` writes outputs/overhead[_quick]_<part>.md and joins the parts found into
# outputs/overhead[_quick].md: host-bound variants take turns (`--method turns`), the GPU-bound
# graphed variants run in pairs.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
workload=(experiment=bench_strategies engine.device=cuda)
both=(--reference both)
start=$SECONDS
processes=0 out=outputs/overhead part=all rounds=4 limit_s=330
steps_dataloader=2500 steps_eager=8000 steps_gather=6000 gather_repeats=2 pair_repeats=2
while [ $# -gt 0 ]; do
  case "$1" in
    --processes) processes=1; shift ;;
    --quick) out=outputs/overhead_quick
             steps_dataloader=800 steps_eager=2000 steps_gather=2000 gather_repeats=1 pair_repeats=1; shift ;;
    --part) part=${2:?"--part needs one of: dataloader eager gather graphed"}; shift 2 ;;
    --rounds) rounds=${2:?"--rounds needs a number"}; shift 2 ;;
    --limit-s) limit_s=${2:?"--limit-s needs a number of seconds"}; shift 2 ;;
    *) break ;;
  esac
done
case "$part" in all|dataloader|eager|gather|graphed) ;;
  *) echo "error: --part $part is not a part: use one of dataloader, eager, gather, graphed" >&2; exit 2 ;;
esac
if [ $processes = 0 ]; then
  if [ "$part" != all ] || [ "$out" != outputs/overhead ]; then
    echo "error: --part and --quick are options of --processes: add --processes, or leave them out" >&2; exit 2
  fi
  # SIGINT at the limit: the tool stops its workers; the rows finished are in the file already.
  status=0
  timeout --signal=INT --kill-after=20 "$limit_s" python -m trainer.overhead "${both[@]}" --method rounds \
    --repeats "$rounds" --turn-ms 250 --graph both --loaders all --markdown "$out.md" "$@" "${workload[@]}" \
    engine.warmup_steps=20 || status=$?
  # The tool printed the table; stopped short of it, the rows it finished are in the file.
  if [ $status != 0 ] && [ -f "$out.md" ]; then cat "$out.md"; fi
  echo "total: $((SECONDS - start)) s"
  exit $status
fi
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
echo "total: $((SECONDS - start)) s"
