"""The reference every engine figure is read against: a plain loop over the same loader.

    python -m trainer.tools.plain_loop [hydra overrides...]      # or: --config composed.yaml

A plain script, in a process of its own: it builds the same dataset, loader strategy, model and
step as `python -m trainer` would for the same overrides, then runs

    for x, y in loader:
        step(x, y)

with nothing else in the loop (a host timestamp per step, kept in an array made beforehand): no
meter, no events, no loss kept, no MLflow. It takes the same
number of steps (`engine.max_steps`, or `engine.epochs` passes), syncs the device after the
first `engine.warmup_steps` and at the end, and prints one JSON line: the wall time per timed
step and the process's minor page faults and CPU time per timed step over the same region.

`python -m trainer.report --plain` runs it for every finished job of a sweep, from the job's own
`config.yaml`, and logs `plain_ms_per_step` and `engine_vs_plain` on the job's run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from datasets import build_dataset
from models import build_model
from trainer.errors import ConfigError, RunFailed
from trainer.loaders import build_loader
from trainer.loop.engine import planned_steps
from trainer.loop.clock import host_usage  # the engine's own count of faults and CPU time
from trainer.loop.steps import build_optimizer, make_step
from trainer.tools.heap import keep_freed
from trainer.tools.turns import pause_if_asked
from trainer.validate import resolve


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(cfg, clock_file: Optional[str] = None) -> dict:
    """Run the plain loop for `cfg` (a composed config) and return its figures; `clock_file`: also
    save when each timed step began and ended (`.npy`, host monotonic clock: one more entry than steps)."""
    resolve(cfg)  # as run() does: no interpolation is parsed again inside the loop
    name = cfg.engine.device
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if cfg.engine.get("steady_heap", True):
        keep_freed()  # as `python -m trainer` does (trainer.tools.heap)
    torch.manual_seed(cfg.engine.seed)
    dataset = build_dataset(cfg.dataset)
    loader = build_loader(cfg.loader, dataset, device, seed=cfg.engine.seed)
    graphed = bool(cfg.engine.cuda_graph) and device.type == "cuda"
    model = build_model(cfg.model, dataset.sample_shape, dataset.num_classes).to(device)
    step = make_step(model, build_optimizer(cfg.engine.optimizer, model, capturable=graphed), graphed)
    total, warmup = planned_steps(cfg.engine, loader), cfg.engine.warmup_steps  # the engine's own length
    done, t0, usage0 = 0, None, None
    clock = np.zeros(total + 1)  # clock[k]: when step k ended (host monotonic clock), for `trainer.tools.turns`
    with loader:
        while done < total:
            for x, y in loader:
                step(x, y)
                done += 1
                clock[done] = time.perf_counter()
                if done == warmup:
                    _sync(device)
                    pause_if_asked()  # under `trainer.tools.turns`: wait here for the process it is compared with
                    t0, usage0 = time.perf_counter(), host_usage()
                    clock[done] = t0
                if done == total:
                    break
        _sync(device)
        t1, usage1 = time.perf_counter(), host_usage()  # the steps alone, as the engine times them: not closing the loader
    timed = done - warmup
    if t0 is None or timed <= 0:
        return {"plain_timed_steps": 0}
    if clock_file:
        np.save(clock_file, clock[warmup:done + 1])  # the timed steps' bounds
    return {"plain_ms_per_step": (t1 - t0) * 1e3 / timed,
            "plain_host_page_faults_per_step": (usage1[0] - usage0[0]) / timed,
            "plain_host_cpu_ms_per_step": (usage1[1] - usage0[1]) * 1e3 / timed,
            "plain_timed_steps": timed}


def run_script(config_path: str) -> dict:
    """`measure` in a fresh process (a plain script, as the reference must be)."""
    proc = subprocess.run([sys.executable, "-m", "trainer.tools.plain_loop", "--config", config_path],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def annotate(client, runs, log=print) -> None:
    """Give each finished single-process run its plain-loop reference: the same config, run
    again as a plain loop, logged on the run as `plain_*` metrics and `engine_vs_plain`
    (the run's ms/step over the plain loop's). Runs that already have one are left alone."""
    for r in runs:
        metrics = r.data.metrics
        if (r.info.status != "FINISHED" or "ms_per_step" not in metrics or "plain_ms_per_step" in metrics
                or int(r.data.tags.get("world_size", "1")) > 1):
            continue
        with tempfile.TemporaryDirectory(prefix="feedbench-plain-") as tmp:
            path = client.download_artifacts(r.info.run_id, "config.yaml", tmp)
            try:
                figures = run_script(path)
            except RuntimeError as e:
                log(f"warning: no plain-loop reference for run {r.info.run_name!r}: {e}")
                continue
        if not figures.get("plain_timed_steps"):
            continue
        figures["engine_vs_plain"] = metrics["ms_per_step"] / figures["plain_ms_per_step"]
        for key, value in figures.items():
            client.log_metric(r.info.run_id, key, float(value))
        r.data.metrics.update(figures)  # so a table built from these runs shows them
        log(f"{r.info.run_name}: engine {metrics['ms_per_step']:.3f} ms/step, "
            f"plain loop {figures['plain_ms_per_step']:.3f}, ratio {figures['engine_vs_plain']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a composed config (YAML), instead of overrides")
    p.add_argument("--clock", help="save the timed steps' bounds on the host clock to this .npy file")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m trainer")
    args = p.parse_args()
    if args.config:
        cfg = OmegaConf.load(args.config)
    else:
        from trainer.tools.overhead import compose_config
        cfg = compose_config(args.overrides)
    try:
        figures = measure(cfg, args.clock)
    except (ConfigError, RunFailed) as e:  # what `python -m trainer` reports in one line, this does too
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
