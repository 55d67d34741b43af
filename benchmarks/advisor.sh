#!/usr/bin/env bash
# The advisor on the GPU, with every recommendation verified (`python -m trainer.advise --verify`),
# on eight workloads:
#   the reference workload (experiment=bench_strategies) fed by baseline, pinned and pinned_chunk
#   (eager), by gpu_resident (graphed), and by baseline with 64 DataLoader workers (far more than
#   the host's cores); the compute-bound preset; the MNIST MLP (mnist_mlp) fed by the plain
#   DataLoader; and a torchvision resnet18 on CIFAR-10 fed by `pinned` (batch 64, no workers).
# MNIST and CIFAR-10 are files of random pixels (`python -m trainer.fake_data`): no download.
# Prints a table: the verdict, the best reachable configuration (its chain of bounds, predicted
# against measured ms/step), the top single change and its predicted against its measured ms/step. Each workload has its own time limit (`timeout`), and the whole script stops starting
# new ones at its deadline: it fits under 6 minutes on one H100 (not yet timed on one).
#   bash benchmarks/advisor.sh                  # the eight advisors and the table
#   bash benchmarks/advisor.sh --window-cost    # then also what the kernel window costs the engine
#                                               # against a plain loop, in turns (a few minutes more)
# Writes outputs/advisor.md (the table, rewritten after each workload) and keeps the runs in
# outputs/advisor/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
deadline=$((start + 340))  # no workload runs past this: the last table and the total come before 6 minutes
store=outputs/advisor
mkdir -p "$store"
rm -f "$store/mlflow.db" "$store/exits.txt"
uri="sqlite:///$PWD/$store/mlflow.db"
data="$store/data"
[ -f "$data/README.txt" ] || python -m trainer.fake_data --root "$data" >/dev/null
vision=("dataset.root=$PWD/$data" dataset.download=false)

table() {  # outputs/advisor.md from the advice runs so far, and how each workload's command ended
  python - "$uri" "$store/exits.txt" > outputs/advisor.md <<'PY'
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

client = MlflowClient(sys.argv[1])
ids = [e.experiment_id for e in client.search_experiments()]
runs = client.search_runs(ids, "tags.advise = 'true'", order_by=["attributes.start_time ASC"])
# Where the files are and which device: the same for every row, not part of the workload.
SAME = ("dataset.root=", "dataset.download=", "engine.device=")
print(f"GPU: {runs[0].data.tags.get('gpu_name', '?')}\n" if runs else "no advice run found")
print("| job | configured ms/step | bound | best configuration | its bounds | predicted ms/step | measured ms/step | "
      "top change | predicted ms/step | measured ms/step | measured ÷ predicted | advisor s |")
print("|---|---:|---|---|---|---:|---:|---|---:|---:|---:|---:|")
for r in runs:
    m, t = r.data.metrics, r.data.tags
    predicted, measured = m.get("change1.predicted_ms"), m.get("change1.measured_ms")
    ratio = f"{measured / predicted:.2f}" if predicted and measured else "—"
    cell = lambda v: f"{v:.3f}" if v is not None else "—"  # noqa: E731
    best = (t.get("best", "as configured"), t.get("best.chain", "—"), cell(m.get("best.predicted_ms")),
            cell(m.get("best.measured_ms")))
    job = " ".join(o for o in t["advise.overrides"].split() if not o.startswith(SAME))
    # A run stopped at its time limit (KILLED) or failed has no verdict.
    bound = t.get("bound", f"— ({r.info.status})")
    took = f"{(r.info.end_time - r.info.start_time) / 1000:.0f}" if r.info.end_time else "—"
    print(f"| {job} | {cell(m.get('ladder.configured_ms'))} | {bound} | {' | '.join(best)} | {t.get('change1', 'none')} | "
          f"{cell(predicted)} | {cell(measured)} | {ratio} | {took} |")
exits = Path(sys.argv[2])
if exits.is_file():
    print("\nHow each workload's command ended (124: stopped at its time limit):\n")
    print("\n".join(f"- {line}" for line in exits.read_text().splitlines()))
PY
}

advise() {  # advise LIMIT_S STEPS OVERRIDES...: one workload's advice, stopped after LIMIT_S seconds
  local limit=$1 steps=$2 began=$SECONDS rc=0
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$*: not run (the script's deadline)" >> "$store/exits.txt"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $* (--steps $steps, at most $limit s)" >&2
  timeout --kill-after=10 "$limit" python -m trainer.advise --verify --steps "$steps" engine.device=cuda \
    "tracking.uri=$uri" "$@" || rc=$?
  echo "$*: exit $rc after $((SECONDS - began)) s" >> "$store/exits.txt"
  table
}

advise 40 100 experiment=bench_strategies loader=baseline
advise 40 100 experiment=bench_strategies loader=pinned
advise 40 100 experiment=bench_strategies loader=pinned_chunk
advise 40 100 experiment=bench_strategies loader=gpu_resident engine.cuda_graph=true
advise 45 100 experiment=bench_compute_bound
# The preset's warm-up is its whole first epoch (938 steps): 50 are enough for the advisor's rungs.
advise 40 100 experiment=mnist_mlp loader=baseline loader.num_workers=0 engine.warmup_steps=50 "${vision[@]}"
advise 45 100 dataset=cifar10 dataset.verify_md5=false model=torchvision model.arch=resnet18 loader=pinned \
  loader.batch_size=64 loader.num_workers=0 engine.warmup_steps=50 "${vision[@]}"
# 64 workers start anew at each of the reference workload's 15-batch epochs: fewer steps a rung.
advise 60 50 experiment=bench_strategies loader=baseline loader.num_workers=64
cat outputs/advisor.md
echo "total: $((SECONDS-start)) s"
if [ "${1:-}" = "--window-cost" ]; then
  # The window runs after the timed region: engine ÷ plain loop should not move with it.
  for steps in 0 20; do
    python -m trainer.overhead --reference plain --method turns --repeats 1 --graph eager --loaders gpu_resident,pinned_chunk \
      --markdown "outputs/advisor_window_$steps.md" experiment=bench_strategies engine.device=cuda engine.max_steps=2000 \
      engine.kernel_window_steps=$steps
  done
  tail -n +1 outputs/advisor_window_0.md outputs/advisor_window_20.md
fi
