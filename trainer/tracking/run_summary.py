"""What a run found, in a few lines: printed on stderr when a run ends (finished, or interrupted:
then what it measured before the interrupt), and by `python -m trainer.report --run ID`.

    run 3f2a… (FINISHED): loader=prefetch dataset=synthetic model=autoencoder on cuda, eager, feedbench loop
      12.35 ms/step (95% interval 12.11 to 12.59, 190 timed steps), 5184 samples/s
      bound by: the data: the loop waited for its next batch 62% of the timed time
      device, per step of the kernel window: 1.83 ms kernels + 0.41 ms gaps in steps + 7.9 ms idle between steps = 10.14 ms; the host waited 7.66 ms per step for data
      report:  python -m trainer.report --run 3f2a…
      UI:      mlflow ui --backend-store-uri sqlite:///…/outputs/mlflow.db --host 127.0.0.1 --port 5000
               then open http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning

Everything is read back from the run as MLflow holds it, so both print the same thing.
`engine.quiet=true` (`python -m trainer -q`) silences the end-of-run summary; a sweep's jobs
print none (the sweep prints its table at the end, `trainer.tracking.sweep`).
"""

from __future__ import annotations

import math
import shlex
import sys
from typing import Dict, List, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from trainer.tracking.journal import shown_status
from trainer.tracking.store import default_uri, shown

UI = "http://127.0.0.1:5000"  # where `mlflow ui` listens by default
# MLflow 3's experiment page opens on its GenAI view (traces); this route and parameter open the
# runs table of the model-training view (MLflow's routes: experimentPageTabRuns, workflowType).
RUNS_TABLE = "#/experiments/{experiment_id}/runs?workflowType=machine_learning"


def tell(cfg, run_id: Optional[str]) -> None:
    """Print the closed run's summary on stderr, unless `engine.quiet`, this process records no
    run (`run_id` None: a rank other than 0) or it is a sweep's job."""
    if run_id is None or cfg.engine.quiet or in_sweep():
        return
    uri = cfg.tracking.uri or default_uri()
    try:
        run = MlflowClient(uri).get_run(run_id)
    except Exception as e:  # the run is recorded; only reading it back for this summary failed
        print(f"run {run_id} recorded; its summary could not be read back ({' '.join(str(e).split())[:200]})",
              file=sys.stderr, flush=True)
        return
    if run.info.status == "RUNNING":  # the store refused its closing records: that line already said where they went
        return
    print(describe(run, uri), file=sys.stderr, flush=True)


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra multirun (on any launcher)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def describe(run: Run, uri: str) -> str:
    """A run in a few lines: what ran, its figures with their spread, what bounds it, and the
    commands that show it."""
    tags, m = run.data.tags, run.data.metrics
    device = tags.get("device", "?")
    how = "CUDA graph" if tags.get("cuda_graph") == "true" else "eager"
    if tags.get("compile", "off") != "off":  # its compile time apart from the steps' (trainer.loop.steps.CompiledStep)
        how = (f"torch.compile mode {tags['compile']} ({m.get('compile_s', math.nan):.1f} s compiling, "
               f"{m.get('compile_recompiles', 0):.0f} recompiles)")
    lines = [f"run {run.info.run_id} ({shown_status(run)}): loader={tags.get('strategy', '?')} "
             f"dataset={tags.get('dataset', '?')} model={tags.get('model', '?')} on {device}, {how}, "
             f"{tags.get('loop', 'feedbench')} loop"]
    if tags.get("degraded") == "true":
        lines.append("  degraded: no CUDA, so the CPU path ran in place of what was asked: these figures do not "
                     "measure the strategy")
    if m.get("timed_steps", 0) > 0:
        lines.append(f"  {figures(m)}")
        lines.append(f"  bound by: {bound_by(m, device)}")
        device_line = device_time(m)
        if device_line:
            lines.append(f"  {device_line}")
        busy = busy_host(m)
        if busy:
            lines.append(f"  noise: {busy}")
    else:
        lines.append(f"  no timed steps: {untimed(run)}")
    lines += commands(run, uri)
    return "\n".join(lines)


def untimed(run: Run) -> str:
    """Why a run timed no step, as fits how it ended: only a finished one ran out of steps in its warm-up."""
    status, done = run.info.status, int(run.data.metrics.get("total_steps", 0))
    if status == "KILLED":
        at = f"after {done} of its {run.data.params.get('engine.warmup_steps', '?')} warm-up steps" if done else \
            "before its first step"
        return f"interrupted ({run.data.tags.get('interrupted_by', 'stopped')}) {at}, before its timed region began"
    if status == "FAILED":
        return "it failed before its timed region began (its error is in the tag `error`)"
    if status == "FINISHED":
        return "set engine.max_steps above engine.warmup_steps"
    return "none recorded yet: a run records its figures when it ends"


def figures(m: Dict[str, float]) -> str:
    """`12.35 ms/step (95% interval 12.11 to 12.59, 190 timed steps), 5184 samples/s`: the interval's
    bounds, as it is not symmetric (`trainer.loop.summary.step_interval`)."""
    ms, low, high = m.get("ms_per_step", math.nan), m.get("ms_per_step_ci_low"), m.get("ms_per_step_ci_high")
    steps = int(m.get("timed_steps", 0))
    if low is None or high is None or math.isnan(low) or math.isnan(high):
        spread = f" (no interval: {steps} timed steps)"
    else:
        spread = f" (95% interval {number(low)} to {number(high)}, {steps} timed steps)"
    return f"{number(ms)} ms/step{spread}, {number(m.get('throughput_samples_per_s', math.nan))} samples/s"


def device_time(m: Dict[str, float]) -> Optional[str]:
    """Where the device's time went per step of the kernel window (`trainer.loop.profiling`), beside
    the host's mean wait for a batch in the timed region; None without the window's step figures."""
    parts = [m.get(k, math.nan) for k in ("gpu_kernel_ms_per_step", "gpu_gap_in_step_ms_per_step",
                                          "gpu_idle_between_steps_ms_per_step", "kernel_window_ms_per_step")]
    if not all(math.isfinite(v) for v in parts):
        return None
    kernels, gaps, idle, wall = parts
    wait = m.get("data_wait_fraction", math.nan) * m.get("ms_per_step", math.nan)
    return (f"device, per step of the kernel window: {number(kernels)} ms kernels + {number(gaps)} ms gaps in steps + "
            f"{number(idle)} ms idle between steps = {number(wall)} ms; the host waited {number(wait)} ms per step for data")


BUSY_PER_CORE = 0.5  # other programs' load, per core the run had, from which its figures are noise


def busy_host(m: Dict[str, float]) -> Optional[str]:
    """Why the run's figures are noise when the host was busy while it ran, else None. Busy: the
    1-minute load average (`host_load_per_core` x `host_cores`) less this process's own share
    (`host_cpu_s_per_wall_s`, the cores it kept busy on average) is at least half of the cores the
    run had. The run's threads then waited for a core at moments no one chose, and its ms/step
    moved with the other programs: two runs a minute apart measured 15.9 and 83.4 ms/step."""
    per_core, cores = m.get("host_load_per_core", math.nan), m.get("host_cores", math.nan)
    own = m.get("host_cpu_s_per_wall_s", math.nan)
    if not (math.isfinite(per_core) and math.isfinite(cores) and cores > 0):
        return None
    load = per_core * cores
    others = max(0.0, load - (own if math.isfinite(own) else 0.0))
    if others < BUSY_PER_CORE * cores:
        return None
    return (f"the host was busy: its 1-minute load average was {load:.1f} on the {cores:.0f} cores this run had, "
            f"{others:.1f} of it other programs' (this process used {own:.2f} CPU-s per s), so the steps waited for a "
            f"core at random moments: these figures measure the other programs as much as this run; run again on a "
            f"quiet machine")


def number(v: float) -> str:
    """Four significant digits, never in exponent form for the sizes a run measures."""
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def bound_by(m: Dict[str, float], device: str) -> str:
    """What bounds the loop, in a phrase from the run's own figures: the share of the timed wall
    time spent waiting for batches (and in Lightning's code), and on CUDA the compute stream's span
    and the copy's share of a step outside the steps' spans. A first reading, not a diagnosis."""
    wait = m.get("data_wait_fraction", math.nan)
    lightning = m.get("lightning_fraction", 0.0)
    if wait >= 0.5:
        return f"the data: the loop waited for its next batch {wait:.0%} of the timed time"
    if lightning >= 0.5:
        return f"Lightning's own code: {lightning:.0%} of the timed time (data wait {wait:.0%})"
    if device != "cuda":
        return f"the step's own work on the CPU (data wait {wait:.0%} of the timed time)"
    span = m.get("compute_stream_span_fraction", math.nan)
    beside = m.get("h2d_beside_step_fraction", math.nan)
    copy = m.get("median_h2d_ms", 0.0) / m["median_step_ms"] if m.get("median_step_ms") else math.nan
    exposed = copy * (1.0 - (0.0 if math.isnan(beside) else beside))
    if span >= 0.8:  # a span, not kernel time: launch gaps count (docs/advisor.md, honest device figures)
        return (f"the step on the GPU: the compute stream's span covers {span:.0%} of the timed time, launch gaps "
                f"included (data wait {wait:.0%})")
    if exposed >= 0.3:
        return f"the host-to-device copy: {exposed:.0%} of a step, outside the steps' spans (data wait {wait:.0%})"
    return f"no single part: data wait {wait:.0%}, compute stream span {span:.0%}, exposed copy {exposed:.0%} of a step"


def commands(run: Run, uri: str) -> List[str]:
    """The commands that show the run: the report, and the MLflow UI opened on its runs table."""
    report = f"python -m trainer.report --run {run.info.run_id}"
    if uri != default_uri():
        report += f" --uri {shlex.quote(shown(uri))}"
    table = RUNS_TABLE.format(experiment_id=run.info.experiment_id)
    if uri.startswith(("http://", "https://")):  # a tracking server serves its own UI
        return [f"  report:  {report}", f"  UI:      open {uri.rstrip('/')}/{table}"]
    return [f"  report:  {report}",
            f"  UI:      mlflow ui --backend-store-uri {shlex.quote(shown(uri))} --host 127.0.0.1 --port 5000",
            f"           then open {UI}/{table}"]
