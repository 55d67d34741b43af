#!/usr/bin/env bash
# Image folders at the GPU's pace: a torchvision resnet18 (untrained) fed generated 224x224 JPEGs by
#   gpu_decode     the files' bytes sent compressed, decoded by nvJPEG, resized and made float on the GPU;
#   prefetch       DataLoader workers decoding with PIL at every epoch (8 and 16 workers), pinned, copied ahead,
#                  as float32 or as uint8 made float on the GPU (dataset.batch_dtype);
#   gpu_resident   every image decoded once at setup and held on the GPU: the model's own ceiling;
# in fp32 and bf16, on a folder of IMAGES files held in memory (more than the timed steps read: no
# epoch ends, where the DataLoader's workers start their queue afresh); then gpu_decode and prefetch
# (16 workers) on a folder of BIG files streamed from disk (dataset.max_host_mb below the files'
# size); last, the decoding rates alone (model=noop: how many images a second each feed makes).
# Tables (python -m trainer.report; one sweep each): outputs/image_decode.md, image_decode_rate.md
# and image_decode_large.md.
#   bash benchmarks/image_decode.sh                      # on one GPU: meant to fit one 6-minute call
#   IMAGES=1024 BIG=0 PRECISIONS=fp32 STEPS=30 bash benchmarks/image_decode.sh   # a shorter check
#   DEVICE=cpu IMAGES=48 BIG=200 STEPS=4 BATCH=8 PRECISIONS=fp32 bash benchmarks/image_decode.sh  # the script, on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
images=${IMAGES:-8192} big=${BIG:-50000} steps=${STEPS:-60} batch=${BATCH:-128} precisions=${PRECISIONS:-fp32,bf16}
mkdir -p outputs
resnet=(model=torchvision model.arch=resnet18)
common=(engine.device="${DEVICE:-cuda}" engine.max_steps="$steps"
        engine.warmup_steps=$((steps / 4)) engine.progress=false loader.batch_size="$batch" dataset=image_folder
        dataset.size=224 tracking.plots=false)
deadline=$(( start + ${DEADLINE_S:-330} ))  # the whole script, within one 6-minute device call
sweep() {  # time limit in seconds (cut to what is left of the deadline), then the arguments of one sweep
  local limit=$1; shift
  local left=$(( deadline - $(date +%s) ))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -le 5 ] && { echo "no time left for: $*" >&2; return; }
  timeout -k 10 "$limit" python -m trainer -m "${common[@]}" "$@" >/dev/null \
    || echo "a sweep ended with status $? after $(( $(date +%s) - start )) s: $*" >&2
}
report() {  # the latest sweep of each experiment named, one Markdown table after the other
  for experiment in "$@"; do
    python -m trainer.report --experiment "$experiment" --markdown "outputs/$experiment.md" >&2 && cat "outputs/$experiment.md"
  done
}
uncache() {  # the folder's files out of the page cache (just written or read, they sit there): "from disk" is from disk
  # Written first: a folder just generated is still being written back, which would slow the run that reads it.
  sync
  python -c "import glob, os, sys
for f in glob.glob(os.path.join(sys.argv[1], '*', '*.jpg')):
    fd = os.open(f, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$1"
}
folder=$(python -m trainer.fake_data --images "$images" --size 224 --root outputs/generated-data | sed -n 's/.* in \(.*\); use them with:/\1/p')
held=$folder
sync  # its files written back before the runs, which read them from the page cache
echo "+ $images JPEGs in $folder ($(du -sh "$folder" | cut -f1)): $(( $(date +%s) - start )) s" >&2
sweep 110 tracking.experiment=image_decode_gpu "${resnet[@]}" dataset.root="$folder" dataset.read_workers=16 \
  loader=gpu_decode,gpu_resident engine.precision="$precisions"
sweep 110 tracking.experiment=image_decode_workers "${resnet[@]}" dataset.root="$folder" loader=prefetch \
  loader.num_workers=8,16 loader.persistent_workers=true engine.precision="$precisions" dataset.batch_dtype=float32,uint8
report image_decode_gpu image_decode_workers > outputs/image_decode.md
echo "+ held folder: $(( $(date +%s) - start )) s" >&2
if [ "$big" -gt 0 ] && [ $(( deadline - $(date +%s) )) -lt 120 ]; then
  echo "no time left for the $big-image folder" >&2
elif [ "$big" -gt 0 ]; then
  folder=$(python -m trainer.fake_data --images "$big" --size 224 --root outputs/generated-data | sed -n 's/.* in \(.*\); use them with:/\1/p')
  mb=$(du -sm "$folder" | cut -f1)
  echo "+ $big JPEGs in $folder ($mb MB): $(( $(date +%s) - start )) s" >&2
  uncache "$folder"
  sweep 90 tracking.experiment=image_decode_large_gpu "${resnet[@]}" dataset.root="$folder" dataset.max_host_mb=$((mb / 4)) \
    loader=gpu_decode engine.precision=fp32
  uncache "$folder"
  sweep 90 tracking.experiment=image_decode_large_workers "${resnet[@]}" dataset.root="$folder" loader=prefetch loader.num_workers=16 \
    loader.persistent_workers=true dataset.batch_dtype=uint8 engine.precision=fp32
  report image_decode_large_gpu image_decode_large_workers > outputs/image_decode_large.md
fi
sweep 50 tracking.experiment=image_decode_rate_gpu model=noop dataset.root="$held" loader=gpu_decode
sweep 60 tracking.experiment=image_decode_rate_workers model=noop dataset.root="$held" loader=prefetch \
  loader.num_workers=8,16 loader.persistent_workers=true dataset.batch_dtype=uint8
report image_decode_rate_gpu image_decode_rate_workers > outputs/image_decode_rate.md
echo "+ decoding rates: $(( $(date +%s) - start )) s" >&2
echo "image_decode.sh: $(( $(date +%s) - start )) s in all" >&2
