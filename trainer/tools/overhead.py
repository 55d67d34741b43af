"""What the engine costs: `python -m trainer` against a plain loop over the same loader.

    python -m trainer.overhead [--repeats 3] [--loaders baseline,prefetch] [--graph eager|graphed|both]
                               [--markdown FILE] [hydra overrides...]

For every strategy (and eager and/or CUDA-graphed step) it runs, alternately and `--repeats`
times each, two fresh processes on the same composed config:

- the CLI path, exactly as a user runs it: `python -m trainer <overrides>` (recorded in a
  throw-away MLflow store), read back as its `ms_per_step` over the timed steps;
- `python -m trainer.tools.plain_loop <overrides>`: `for x, y in loader: step(x, y)` in a plain
  script, timed over the same steps the same way (a device sync at both ends of the timed region).

It prints each pair's ratio (engine ÷ plain: 1.00 means the engine adds nothing) and, per
variant, the medians and a 95% interval of the ratio (whether the pairs tell it apart from 1),
with the host's minor page faults and CPU time per step on each side. The pairs alternate which
side runs first (engine, plain; plain, engine; ...), so drift in the machine's speed hits both
alike. Any override works (`model=noop`, `engine.device=cpu`, `experiment=bench_seed0` for seed
000's workload).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

from hydra import compose, initialize_config_dir

from trainer.config import CONF_DIR

GRAPH = {"eager": ["false"], "graphed": ["true"], "both": ["false", "true"]}
QUICK = ["engine.progress=false"]


def compose_config(overrides: Sequence[str]):
    """The config `python -m trainer <overrides>` would run; a bad override ends the program
    with Hydra's one-line reason, as `python -m trainer` does."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    import trainer.config  # noqa: F401  (registers the schemas)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        reason = " ".join(str(e).split())  # Hydra's message spans lines: the key and the fix, on one
        raise SystemExit(f"error: {reason}") from None


def _run(cmd: List[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed:\n{proc.stderr[-2000:]}")
    return proc


def engine_run(overrides: List[str], tmp: Path) -> Dict[str, float]:
    """One `python -m trainer` run; its summary read back from MLflow."""
    from mlflow.tracking import MlflowClient  # here: the plain loop composes its config through this module
    uri = f"sqlite:///{tmp / 'overhead.db'}"
    _run([sys.executable, "-m", "trainer", *overrides, f"tracking.uri={uri}", "tracking.experiment=overhead",
          f"hydra.run.dir={tmp / 'hydra'}"], tmp)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("overhead")
    (latest,) = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return latest.data.metrics


def plain_run(overrides: List[str], tmp: Path) -> Dict[str, float]:
    proc = _run([sys.executable, "-m", "trainer.tools.plain_loop", *overrides], tmp)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(overrides: List[str], repeats: int, tmp: Path, log=print) -> Dict[str, float]:
    """`repeats` alternating engine/plain pairs for one variant; medians and per-pair ratios."""
    engine, plain = [], []
    for r in range(repeats):
        # Engine first in odd pairs, plain loop first in even ones (E P P E E P ...): a machine
        # that speeds up or slows down over the pairs then favours neither side.
        seconds = {}
        for side in (("engine", "plain") if r % 2 == 0 else ("plain", "engine")):
            t0 = time.perf_counter()
            if side == "engine":
                engine.append(engine_run(overrides, tmp))
            else:
                plain.append(plain_run(overrides, tmp))
            seconds[side] = time.perf_counter() - t0
        e, p = engine[-1]["ms_per_step"], plain[-1]["plain_ms_per_step"]
        log(f"  repeat {r + 1}: engine {e:.3f} ms/step, plain {p:.3f} ms/step, ratio {e / p:.3f} "
            f"(processes: engine {seconds['engine']:.0f} s, plain {seconds['plain']:.0f} s)")
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    ratios = [e["ms_per_step"] / p["plain_ms_per_step"] for e, p in zip(engine, plain)]
    low, high = ratio_interval(ratios)
    return {"engine_ms": med(engine, "ms_per_step"), "plain_ms": med(plain, "plain_ms_per_step"),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_ci_low": low, "ratio_ci_high": high,
            "engine_spread": max(x["ms_per_step"] for x in engine) / min(x["ms_per_step"] for x in engine),
            "engine_faults": med(engine, "host_page_faults_per_step"),
            "plain_faults": med(plain, "plain_host_page_faults_per_step"),
            "engine_cpu_ms": med(engine, "host_cpu_ms_per_step"),
            "plain_cpu_ms": med(plain, "plain_host_cpu_ms_per_step")}


# Student's t, two-sided 95%, by degrees of freedom (1..30); 2.0 beyond (at most 2% too narrow).
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13,
        2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def ratio_interval(ratios: Sequence[float]) -> tuple:
    """95% confidence interval of the engine ÷ plain ratio from the pairs' ratios (a t interval
    on their logarithms: ratios multiply). It says whether the pairs can tell the ratio from 1:
    an interval that holds 1.05 has not shown the engine within 5%. Needs two pairs (else nan)."""
    if len(ratios) < 2:
        return math.nan, math.nan
    logs = [math.log(r) for r in ratios]
    t = _T95[len(logs) - 2] if len(logs) - 1 <= len(_T95) else 2.0
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def table(rows: List[dict]) -> str:
    head = ("| loader | CUDA graph | engine ms/step | plain loop ms/step | engine ÷ plain (min–max) | 95% interval "
            "| engine max/min | page faults/step engine / plain | host CPU ms/step engine / plain |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"| `{r['loader']}` | {'yes' if r['graph'] == 'true' else 'no'} | {r['engine_ms']:.3f} | {r['plain_ms']:.3f} "
             f"| {r['ratio']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | {_interval(r)} | {r['engine_spread']:.2f} "
             f"| {r['engine_faults']:.0f} / {r['plain_faults']:.0f} | {r['engine_cpu_ms']:.2f} / {r['plain_cpu_ms']:.2f} |"
             for r in rows]
    return "\n".join([head, *lines])


def _interval(row: dict) -> str:
    low, high = row["ratio_ci_low"], row["ratio_ci_high"]
    return "–" if math.isnan(low) else f"{low:.2f}–{high:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="engine/plain pairs per variant")
    p.add_argument("--loaders", default="", help="comma-separated strategies (default: the composed one)")
    p.add_argument("--graph", choices=sorted(GRAPH), default="eager", help="time the eager step, the graphed one, or both")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=noop engine.device=cpu")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be >= 1 (got {args.repeats}): use --repeats 3")
    base = QUICK + args.overrides
    cfg = compose_config(base)  # fail here, once, on a bad override
    loaders = [s for s in args.loaders.split(",") if s] or [cfg.loader.name]
    rows = []
    with tempfile.TemporaryDirectory(prefix="feedbench-overhead-") as tmp:
        for loader in loaders:
            for graph in GRAPH[args.graph]:
                overrides = [*base, f"loader={loader}", f"engine.cuda_graph={graph}"]
                print(f"loader={loader} engine.cuda_graph={graph}", flush=True)
                rows.append({"loader": loader, "graph": graph, **measure(overrides, args.repeats, Path(tmp))})
    print(table(rows))
    if args.markdown:
        Path(args.markdown).write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
