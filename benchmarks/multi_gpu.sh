#!/usr/bin/env bash
# The multi_gpu preset on 1, 2 and 4 GPUs of this host (those it has), one torchrun launch per GPU
# count; on several GPUs, also the strategies that hold the whole dataset on the host with a copy
# per rank (loader.shared_host_copy=false), for the host memory they take; then one scaling table
# of the latest launch of each:
#   bash benchmarks/multi_gpu.sh               # GPU counts 1 2 4
#   COUNTS="1 2" bash benchmarks/multi_gpu.sh  # only these
# Extra arguments go to every launch (e.g. engine.max_steps=100). Each launch is limited to
# LAUNCH_S seconds (default 240), and all of them to DEADLINE_S from the start (default 330: one
# device call): one that hangs is stopped, one without time left is skipped and said, and the
# table shows what finished. On two GPUs the whole script took 257-336 s (2026-11-28); on four it
# took 298-382 s before the all-reduce rows were added, so there the deadline skips the last parts.
# At each GPU count, the strategies that feed the GPU from device or page-locked memory also run
# with the step captured as a CUDA graph, the exchange inside it (loader.drop_last=true: a graph
# with several ranks needs every batch full; experiment multi_gpu_graphed, its own table): the
# gradients averaged by one all-reduce of a flat buffer (distributed.sync=allreduce), and on
# several GPUs also sharded (a reduce-scatter, each rank's optimizer updating its slice of the
# weights, an all-gather; one GPU exchanges nothing, so its allreduce row is the reference of
# both). The same steps written by hand on GPU-resident data (benchmarks/ddp_floor.py: with DDP,
# eager; with one all-reduce and sharded, in a graph) are the references for `gpu_resident`: one
# JSON line each in outputs/multi_gpu_floor.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p outputs
start=$(date +%s)
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
deadline=$(( start + ${DEADLINE_S:-330} ))  # the whole script, within one 6-minute device call
launch() {  # GPU count, then the arguments of one torchrun launch (cut to what is left of the deadline)
  local n=$1; shift
  local limit=${LAUNCH_S:-240} left=$(( deadline - $(date +%s) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then echo "no time left for the launch on $n GPU(s): $*" >&2; return; fi
  timeout -k 10 "$limit" python -m torch.distributed.run --standalone --nproc_per_node="$n" -m trainer -m "$@" \
    || echo "launch on $n GPU(s) ended with status $? after $(( $(date +%s) - start )) s: $*" >&2
}
for n in ${COUNTS:-1 2 4}; do
  if [ "$n" -gt "$gpus" ]; then
    echo "skipping $n GPUs: this host has $gpus" >&2
    continue
  fi
  launch "$n" experiment=multi_gpu "$@"
  exchanges=allreduce
  [ "$n" -gt 1 ] && exchanges=allreduce,sharded,sharded_copy
  launch "$n" experiment=multi_gpu loader=gpu_resident,pinned_chunk,pinned_uva model=autoencoder \
    +experiment/grad_exchange=$exchanges distributed.bucket_cap_mb=${COPY_BUCKET_MB:-8} \
    engine.cuda_graph=true loader.drop_last=true tracking.experiment=multi_gpu_graphed "$@"
  if [ "$n" -gt 1 ]; then
    launch "$n" experiment=multi_gpu loader=pinned_chunk,pinned_uva,pinned_gather model=noop \
      'loader.shared_host_copy=choice(false)' tracking.experiment=multi_gpu_own_copies "$@"
  fi
  # the references of the eager DDP rows and of the graphed ones; on several GPUs also each rank's
  # step alone against all of them, in turns (efficiency_in_turns; not for sharded)
  for how in "--sync ddp" "--sync allreduce --graph" "--sync sharded --graph" "--sync sharded-copy --graph --bucket-mb ${COPY_BUCKET_MB:-8}"; do
    [ "$n" -eq 1 ] && [[ "$how" == "--sync sharded"* ]] && continue  # alone, the same loop as allreduce
    [ $(( deadline - $(date +%s) )) -lt 25 ] && { echo "no time left for ddp_floor.py $how on $n GPU(s)" >&2; continue; }
    turns="--turns 4"; [[ "$how" == "--sync sharded"* ]] && turns=""  # (ddp_floor.py refuses turns with them)
    timeout -k 10 60 python -m torch.distributed.run --standalone --nproc_per_node="$n" benchmarks/ddp_floor.py $how $turns \
      | tee -a outputs/multi_gpu_floor.jsonl || echo "the hand-written loop ($how) on $n GPU(s) ended with status $?" >&2
  done
  echo "after $n GPU(s): $(( $(date +%s) - start )) s" >&2
done
python -m trainer.tools.scaling --experiment multi_gpu --markdown docs/results/multi_gpu.md
python -m trainer.tools.scaling --experiment multi_gpu_graphed --markdown docs/results/multi_gpu_graphed.md
echo "multi_gpu.sh: $(( $(date +%s) - start )) s in all" >&2
