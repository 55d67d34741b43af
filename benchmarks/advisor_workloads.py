"""The eight workloads the advisor is checked on (benchmarks/advisor.sh, advisor_sweep.py), and
how both scripts compose, time-limit and run them in one process.

Each workload: (label, its advisor's time limit in seconds, timed steps a rung, overrides). The
data-file workloads read trainer.fake_data's MNIST and CIFAR-10 files under `DATA`.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "outputs" / "advisor" / "data"
VISION = [f"dataset.root={DATA}", "dataset.download=false"]

WORKLOADS: List[Tuple[str, int, int, List[str]]] = [
    ("reference, baseline", 50, 100, ["experiment=bench_strategies", "loader=baseline"]),
    ("reference, pinned", 40, 100, ["experiment=bench_strategies", "loader=pinned"]),
    ("reference, pinned_chunk", 35, 100, ["experiment=bench_strategies", "loader=pinned_chunk"]),
    ("reference, gpu_resident graphed", 30, 100,
     ["experiment=bench_strategies", "loader=gpu_resident", "engine.cuda_graph=true"]),
    ("compute-bound preset", 85, 50, ["experiment=bench_compute_bound"]),
    # The preset's warm-up is its whole first epoch (938 steps): 50 are enough for the rungs. The
    # CLI's 300 steps a rung: at 100, its 1.1 ms eager step was timed for 0.1 s, and read 0.91 to
    # 1.18 ms/step from one run to the next on an H200.
    ("MNIST MLP, baseline, 0 workers", 45, 300,
     ["experiment=mnist_mlp", "loader=baseline", "loader.num_workers=0", "engine.warmup_steps=50", *VISION]),
    ("CIFAR-10 resnet18, pinned, 0 workers", 80, 100,
     ["dataset=cifar10", "dataset.verify_md5=false", "model=torchvision", "model.arch=resnet18", "loader=pinned",
      "loader.batch_size=64", "loader.num_workers=0", "engine.warmup_steps=50", *VISION]),
    # 64 workers start anew at each of the reference workload's 15-batch epochs: fewer steps a rung,
    # and one epoch of warm-up (every epoch starts its workers again: more warm-up warms nothing).
    ("reference, baseline, 64 workers", 90, 50,
     ["experiment=bench_strategies", "loader=baseline", "loader.num_workers=64", "engine.warmup_steps=15"]),
]


def ensure_data() -> None:
    """trainer.fake_data's MNIST and CIFAR-10 files (random pixels), written once."""
    from trainer.fake_data import MARKER, write_both
    if not (DATA / MARKER).is_file():
        write_both(DATA)


def compose(overrides: List[str]):
    """The config `python -m trainer` would run with these overrides, on CUDA where there is one
    (elsewhere on the CPU: a check of the scripts, not their figures)."""
    import torch
    from hydra import compose as hydra_compose, initialize_config_dir
    from trainer.config import CONF_DIR
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, f"engine.device={device}"])


class Limit:
    """What `time_limit` yields: whether its alarm fired (an interrupt without it is the user's)."""
    fired = False


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[Limit]:
    """SIGTERM to this process after `seconds`: a run in progress is closed KILLED with what it
    measured (the engine's own handling), and `trainer.errors.Interrupted` ends the block. The
    caller tells its own limit from a Ctrl-C or an outside SIGTERM by `limit.fired`."""
    from trainer.errors import Interrupted

    limit = Limit()

    def term(signum, frame):
        raise Interrupted(signum)

    def alarm(signum, frame):
        limit.fired = True
        os.kill(os.getpid(), signal.SIGTERM)

    before_term = signal.signal(signal.SIGTERM, term)
    before_alarm = signal.signal(signal.SIGALRM, alarm)
    # A short repeat: an interrupt raised where Python drops it (a __del__, a weakref callback)
    # comes again rather than never.
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01), 1.0)
    try:
        yield limit
    finally:
        # Both signals held while the handlers are put back: one that comes now waits for the
        # handlers before, instead of raising here and leaving ours in place.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before_alarm)
            signal.signal(signal.SIGTERM, before_term)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM, signal.SIGTERM})
