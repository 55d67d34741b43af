#!/usr/bin/env bash
# Run the presets of docs/results.md on this machine's GPU, one sweep each, then a plain loop for
# each job (`trainer.report --plain`: the reference for the engine's figures and, in the Lightning
# presets, for Lightning's loop too), then write their tables into docs/results.md and their
# pictures into docs/results/.
#   bash benchmarks/run_results.sh                  # every preset: about 5 minutes on one H100 or H200, plus the two Lightning ones
#   bash benchmarks/run_results.sh limits copy_4gb  # some of them (the page takes each preset's latest sweep)
# MNIST and CIFAR-10 are read from data/ when torchvision's files are there. Otherwise files of the
# real format and size, filled with random pixels, are generated once in outputs/generated-data
# (`python -m trainer.fake_data --full`): the per-sample path (PIL image, ToTensor, Normalize) costs
# the same whatever the pixels are.
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(limits copy_4gb iterable_chunk_loaders pin_memory_cifar mnist_mlp dataloader_grid lightning_vs_loop gpu_prefetch)
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: docs/results.md is measured on a GPU')"

generated=$PWD/outputs/generated-data
mnist=() cifar=()
if [ ! -f data/MNIST/raw/train-images-idx3-ubyte ] || [ ! -f data/cifar-10-batches-py/data_batch_5 ]; then
  [ -f "$generated/README.txt" ] || python -m trainer.fake_data --full --root "$generated"
fi
if [ ! -f data/MNIST/raw/train-images-idx3-ubyte ]; then
  mnist=(dataset.root="$generated" dataset.download=false)
fi
if [ ! -f data/cifar-10-batches-py/data_batch_5 ]; then
  cifar=(dataset.root="$generated" dataset.download=false dataset.verify_md5=false)
fi

for preset in "${presets[@]}"; do
  case $preset in
    mnist_mlp) extra=(${mnist[@]+"${mnist[@]}"}) ;;
    pin_memory_cifar | dataloader_grid) extra=(${cifar[@]+"${cifar[@]}"}) ;;
    *) extra=() ;;
  esac
  start=$SECONDS
  echo "+ python -m trainer -m experiment=$preset engine.device=cuda ${extra[*]+${extra[*]}}"
  python -m trainer -m experiment="$preset" engine.device=cuda ${extra[@]+"${extra[@]}"}
  # Each job's plain-loop reference. A Lightning job's is the same loader and step in a plain
  # loop: the reference for Lightning's loop and for ours alike.
  python -m trainer.report --experiment "$preset" --plain >/dev/null
  echo "$preset: $((SECONDS - start)) s"
done
python benchmarks/results.py --update docs/results.md --images docs/results
