#!/usr/bin/env bash
# Your own data and model, measured: torchvision's resnet18 (model=torchvision, untrained) fed by every
# strategy, in fp32 and bf16, on
#   cifar   CIFAR-shaped uint8 data (dataset=synthetic dtype=uint8 shape=[3,32,32]): copying is cheap,
#           the step is short, and bf16 makes it shorter;
#   images  a generated folder of 224x224 JPEGs (dataset=image_folder): the DataLoader strategies
#           decode every image at every epoch in their workers, the one-block strategies once at setup
#           (their setup_s) and copy uint8.
# One sweep each (python -m trainer -m), then its table (python -m trainer.report), written to
# outputs/own_data_cifar.md and outputs/own_data_images.md (the table of docs/benchmark.md).
#   bash benchmarks/own_data.sh                 # on a GPU: meant to take under 4 minutes on one H100
#   bash benchmarks/own_data.sh loader.num_workers=16   # extra overrides go to both sweeps
#   DEVICE=cpu SAMPLES=64 IMAGES=24 SIZE=32 STEPS=4 BATCH=8 WORKERS=2 bash benchmarks/own_data.sh   # a check of the script on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
device=${DEVICE:-cuda} samples=${SAMPLES:-50000} images=${IMAGES:-1024} size=${SIZE:-224}
steps=${STEPS:-60} batch=${BATCH:-256} workers=${WORKERS:-8}
mkdir -p outputs
strategies=baseline,pinned,prefetch,pinned_chunk,pinned_gather,pinned_uva,gpu_resident
common=(model=torchvision model.arch=resnet18 "loader=$strategies" engine.precision=fp32,bf16 engine.device="$device"
        engine.max_steps="$steps" engine.warmup_steps=$((steps / 4)) engine.progress=false
        loader.num_workers="$workers" loader.persistent_workers=true)

folder=$PWD/outputs/generated-data/images-$size-$images
echo "+ $images ${size}x$size JPEGs (10 classes) in $folder"
python -m trainer.fake_data --images "$images" --size "$size" --root outputs/generated-data >/dev/null

start=$SECONDS
echo "+ cifar: resnet18 on $samples CIFAR-shaped uint8 samples, batches of $batch"
python -m trainer -m "${common[@]}" tracking.experiment=own_data_cifar dataset=synthetic dataset.dtype=uint8 \
  "dataset.shape=[3,32,32]" dataset.num_samples="$samples" loader.batch_size="$batch" "$@"
python -m trainer.report --experiment own_data_cifar --markdown outputs/own_data_cifar.md >/dev/null
echo "cifar: $((SECONDS - start)) s"

start=$SECONDS
echo "+ images: resnet18 on $images JPEGs decoded to ${size}x$size, batches of $((batch / 2))"
python -m trainer -m "${common[@]}" tracking.experiment=own_data_images dataset=image_folder dataset.root="$folder" \
  dataset.size="$size" dataset.read_workers="$workers" loader.batch_size=$((batch / 2)) "$@"
python -m trainer.report --experiment own_data_images --markdown outputs/own_data_images.md >/dev/null
echo "images: $((SECONDS - start)) s"
for sweep in cifar images; do
  echo; echo "$sweep (outputs/own_data_$sweep.md):"; cat "outputs/own_data_$sweep.md"
done
