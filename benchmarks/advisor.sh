#!/usr/bin/env bash
# The advisor on the GPU, with every recommendation verified (`python -m trainer.advise --verify`),
# on eight workloads (benchmarks/advisor_workloads.py):
#   the reference workload (experiment=bench_strategies) fed by baseline, pinned and pinned_chunk
#   (eager), by gpu_resident (graphed), and by baseline with 64 DataLoader workers (far more than
#   the host's cores); the compute-bound preset; the MNIST MLP (mnist_mlp) fed by the plain
#   DataLoader; and a torchvision resnet18 on CIFAR-10 fed by `pinned` (batch 64, no workers).
# MNIST and CIFAR-10 are files of random pixels (`trainer.fake_data`): no download.
# All eight run in one process (benchmarks/advisor_table.py), each under its own time limit, none
# started past 325 s (340 s, less 15 for its start): on three H200s they took 9-51 s each, 236-275 s in all
# (docs/advisor.md), so a slower host may see the last one stopped at the deadline; the table and the total come
# before 6 minutes.
#   bash benchmarks/advisor.sh                  # the eight advisors and the table
#   bash benchmarks/advisor.sh --sweep          # instead: the exhaustive sweep of every workload
#                                               # (benchmarks/advisor_sweep.py, its own 6 minutes; on a
#                                               # fresh machine, bring the first command's
#                                               # outputs/advisor.json: each best configuration is
#                                               # timed in turns with the sweep's fastest), then the
#                                               # table again with its fastest rows
#   bash benchmarks/advisor.sh --window-cost    # then also what the kernel window costs the engine
#                                               # against a plain loop, in turns (a few minutes more)
# Writes outputs/advisor.md (the table, rewritten after each workload; .json beside it) and keeps
# the runs in outputs/advisor/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs/advisor
if [ "${1:-}" = "--sweep" ]; then
  timeout --kill-after=10 ${SWEEP_LIMIT_S:-350} python benchmarks/advisor_sweep.py --only 7,1,6,5 \
    ${SWEEP_DEADLINE_S:+--deadline $SWEEP_DEADLINE_S} || echo "sweep: exit $? (124: stopped at its time limit)" >&2
  [ -f outputs/advisor.json ] && python benchmarks/advisor_table.py --render
  exit 0
fi
rm -f outputs/advisor/mlflow.db
timeout --kill-after=10 ${ADVISOR_LIMIT_S:-355} python benchmarks/advisor_table.py ${ADVISOR_DEADLINE_S:+--deadline $ADVISOR_DEADLINE_S} \
  || echo "advisor table: exit $? (124: stopped at its time limit)" >&2
if [ "${1:-}" = "--window-cost" ]; then
  # The window runs after the timed region: engine ÷ plain loop should not move with it.
  for steps in 0 20; do
    python -m trainer.overhead --reference plain --method turns --repeats 1 --graph eager --loaders gpu_resident,pinned_chunk \
      --markdown "outputs/advisor_window_$steps.md" experiment=bench_strategies engine.device=cuda engine.max_steps=2000 \
      engine.kernel_window_steps=$steps
  done
  tail -n +1 outputs/advisor_window_0.md outputs/advisor_window_20.md
fi
