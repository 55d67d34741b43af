#!/usr/bin/env bash
# Run the seed presets and `limits` on this machine's GPU, one sweep each, then a plain loop for
# each job (`trainer.report --plain`: the reference for the engine's figures and, in the Lightning
# presets, for Lightning's loop too), then write their tables into docs/results.md and their
# pictures into docs/results/.
#   bash benchmarks/run_results.sh                      # every preset: about 5 minutes on one H100 or H200, plus the two Lightning ones
#   bash benchmarks/run_results.sh limits seed000_copy  # some of them (the page takes each preset's latest sweep)
# MNIST and CIFAR-10 are read from data/ when torchvision's files are there. Otherwise files of the
# real format and size, filled with random pixels, are generated once in outputs/generated-data:
# the per-sample path (PIL image, ToTensor, Normalize) costs the same whatever the pixels are.
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(limits seed000_copy seed000_loaders seed002 seed003 seed004 seed000_lightning seed001)
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: docs/results.md is measured on a GPU')"

generated=$PWD/outputs/generated-data
mnist=() cifar=()
if [ ! -f data/MNIST/raw/train-images-idx3-ubyte ]; then
  [ -f "$generated/MNIST/raw/train-images-idx3-ubyte" ] || python tests/fake_data.py mnist "$generated"
  mnist=(dataset.root="$generated" dataset.download=false)
fi
if [ ! -f data/cifar-10-batches-py/data_batch_5 ]; then
  [ -f "$generated/cifar-10-batches-py/data_batch_5" ] || python tests/fake_data.py cifar10 "$generated"
  cifar=(dataset.root="$generated" dataset.download=false dataset.verify_md5=false)
fi

for preset in "${presets[@]}"; do
  case $preset in
    seed003) extra=(${mnist[@]+"${mnist[@]}"}) ;;
    seed002 | seed004) extra=(${cifar[@]+"${cifar[@]}"}) ;;
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
