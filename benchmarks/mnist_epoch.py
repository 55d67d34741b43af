"""MNIST in one process: the epoch time of each way of feeding a small MLP (docs/mnist_epoch.md).

    python benchmarks/mnist_epoch.py [--workers N] [override ...]

Each case is one ordinary run (`trainer.loop.run.run`) recorded in MLflow under the experiment
`mnist_epoch`; the table is read back from those runs. A run trains 2 epochs with the whole
first epoch as warm-up, so its `timed_wall_s` is exactly the second epoch (synchronised at both
ends; DataLoader workers are started again for it, as in the notebook it reruns). Overrides apply to every
case, e.g. `dataset.root=/data dataset.download=false` or `tracking.uri=sqlite:////tmp/m.db`.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import List, Tuple

from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

import trainer.components  # noqa: F401  (registers every dataset, loader and model option)
from datasets import build_dataset
from trainer.config import CONF_DIR
from trainer.loop.run import run
from trainer.tracking.store import default_uri

EXPERIMENT = "mnist_epoch"
# The notebook of experiment=mnist_mlp: MNIST, Flatten-Linear(784,512)-ReLU-Linear(512,10), SGD lr 0.01, batch 64, shuffled.
COMMON = ["dataset=mnist", "model=mlp", "model.hidden=512", "loader.batch_size=64", "loader.shuffle=true",
          "engine.optimizer.name=sgd", "engine.optimizer.lr=0.01", "engine.epochs=2", "engine.progress=false",
          f"tracking.experiment={EXPERIMENT}"]


def cases(workers: int) -> List[Tuple[str, List[str]]]:
    """(label, overrides): the notebook's two DataLoader settings, the two halves of the change between
    them (workers alone, pinning alone), and the tensor path from host memory and from GPU memory,
    eager and CUDA-graphed."""
    return [
        ("per-sample, 0 workers (the notebook's first loader)", ["loader=baseline", "loader.num_workers=0"]),
        (f"per-sample, {workers} workers", ["loader=baseline", f"loader.num_workers={workers}"]),
        ("per-sample, 0 workers, pin_memory + non_blocking", ["loader=pinned", "loader.num_workers=0"]),
        (f"per-sample, {workers} workers, pin_memory + non_blocking (the notebook's second loader)",
         ["loader=pinned", f"loader.num_workers={workers}"]),
        ("uint8 tensor in host memory, gathered into pinned slots (pinned_gather)", ["loader=pinned_gather"]),
        ("uint8 tensor in host memory, gathered into pinned slots (pinned_gather) + cuda_graph",
         ["loader=pinned_gather", "engine.cuda_graph=true"]),
        ("uint8 tensor on the GPU (gpu_resident)", ["loader=gpu_resident"]),
        ("uint8 tensor on the GPU (gpu_resident) + cuda_graph", ["loader=gpu_resident", "engine.cuda_graph=true"]),
    ]


def compose_case(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def table(uri: str, names: List[Tuple[str, str]]) -> str:
    """Markdown table of the runs called `names` ((label, run name) pairs), read from MLflow."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    lines = ["| case | epoch (s) | samples/s | data wait | stream span | final loss | MLflow run |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for label, name in names:
        found = client.search_runs([exp.experiment_id], filter_string=f"attributes.run_name = '{name}'")
        if not found:
            lines.append(f"| {label} | (no run) | | | | | {name} |")
            continue
        m = found[0].data.metrics
        lines.append(f"| {label} | {m['timed_wall_s']:.2f} | {m['throughput_samples_per_s']:,.0f} | "
                     f"{m['data_wait_fraction']:.2f} | {m['compute_stream_span_fraction']:.2f} | {m['final_loss']:.3f} | {name} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="DataLoader workers of the multi-worker cases (the notebook: cpu_count() // 2)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides applied to every case")
    args = parser.parse_args()

    # One epoch of warm-up: the timed region is then exactly epoch 2.
    probe = compose_case(*COMMON, *args.overrides)
    steps_per_epoch = math.ceil(len(build_dataset(probe.dataset)) / probe.loader.batch_size)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    names = []
    for i, (label, overrides) in enumerate(cases(args.workers)):
        name = f"mnist_epoch {stamp} #{i + 1}"
        cfg = compose_case(*COMMON, f"engine.warmup_steps={steps_per_epoch}", *overrides, *args.overrides,
                           f"tracking.run_name='{name}'")
        print(f"{name}: {label}", flush=True)
        run(cfg)
        names.append((label, name))
    print()
    print(table(probe.tracking.uri or default_uri(), names))


if __name__ == "__main__":
    main()
