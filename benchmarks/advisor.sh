#!/usr/bin/env bash
# The advisor on the GPU, with every recommendation verified (`python -m trainer.advise --verify`):
# the reference workload's workload fed by baseline, pinned and pinned_chunk (eager) and gpu_resident (graphed),
# the compute-bound preset, and the MNIST MLP (mnist_mlp) fed by the plain DataLoader (generated MNIST
# files: no download). Prints a table: the verdict, the top recommendation, and its predicted
# against its measured ms/step. Meant to take under 5 minutes on an H100.
#   bash benchmarks/advisor.sh                  # the six advisors and the table
#   bash benchmarks/advisor.sh --window-cost    # then also what the kernel window costs the engine
#                                               # against a plain loop, in turns (a few minutes more)
# Writes outputs/advisor.md (the table) and keeps the runs in outputs/advisor/mlflow.db.
set -euo pipefail
cd "$(dirname "$0")/.."
store=outputs/advisor
mkdir -p "$store"
rm -f "$store/mlflow.db"
uri="sqlite:///$PWD/$store/mlflow.db"
mnist="$store/data"
[ -f "$mnist/MNIST/raw/train-images-idx3-ubyte" ] || python tests/fake_data.py mnist "$mnist" --n 60000 >/dev/null
common=(--verify --steps 200)
seed0=(experiment=bench_strategies engine.device=cuda "tracking.uri=$uri")
python -m trainer.advise "${common[@]}" "${seed0[@]}" loader=baseline
python -m trainer.advise "${common[@]}" "${seed0[@]}" loader=pinned
python -m trainer.advise "${common[@]}" "${seed0[@]}" loader=pinned_chunk
python -m trainer.advise "${common[@]}" "${seed0[@]}" loader=gpu_resident engine.cuda_graph=true
python -m trainer.advise "${common[@]}" experiment=bench_compute_bound engine.device=cuda "tracking.uri=$uri"
python -m trainer.advise "${common[@]}" experiment=mnist_mlp loader=baseline loader.num_workers=0 engine.warmup_steps=50 \
  "dataset.root=$PWD/$mnist" dataset.download=false engine.device=cuda "tracking.uri=$uri"
python - "$uri" <<'PY' | tee outputs/advisor.md
import sys
from mlflow.tracking import MlflowClient

client = MlflowClient(sys.argv[1])
ids = [e.experiment_id for e in client.search_experiments()]
runs = client.search_runs(ids, "tags.advise = 'true'", order_by=["attributes.start_time ASC"])
print(f"GPU: {runs[0].data.tags.get('gpu_name', '?')}\n" if runs else "no advice run found")
print("| job | configured ms/step | bound | top change | predicted ms/step | measured ms/step | measured ÷ predicted |")
print("|---|---:|---|---|---:|---:|---:|")
for r in runs:
    m, t = r.data.metrics, r.data.tags
    predicted, measured = m.get("change1.predicted_ms"), m.get("change1.measured_ms")
    ratio = f"{measured / predicted:.2f}" if predicted and measured else "—"
    cell = lambda v: f"{v:.3f}" if v is not None else "—"  # noqa: E731
    print(f"| {t['advise.overrides']} | {cell(m.get('ladder.configured_ms'))} | {t['bound']} | "
          f"{t.get('change1', 'none')} | {cell(predicted)} | {cell(measured)} | {ratio} |")
PY
if [ "${1:-}" = "--window-cost" ]; then
  # The window runs after the timed region: engine ÷ plain loop should not move with it.
  for steps in 0 20; do
    python -m trainer.overhead --reference plain --method turns --repeats 1 --graph eager --loaders gpu_resident,pinned_chunk \
      --markdown "outputs/advisor_window_$steps.md" experiment=bench_strategies engine.device=cuda engine.max_steps=2000 \
      engine.kernel_window_steps=$steps
  done
  tail -n +1 outputs/advisor_window_0.md outputs/advisor_window_20.md
fi
