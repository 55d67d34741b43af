"""What the engine costs: `python -m trainer` against a plain loop over the same loader.

    python -m trainer.overhead [--repeats 3] [--loaders baseline,prefetch|all] [--graph eager|graphed|both]
                               [--reference plain|hand|both] [--method auto|pairs|turns|rounds] [--turn-ms 100]
                               [--markdown FILE] [hydra overrides...]

For every strategy (and eager and/or CUDA-graphed step) it compares, `--repeats` times, two fresh
processes on the same composed config:

- the CLI path, exactly as a user runs it: `python -m trainer <overrides>` (recorded in a
  throw-away MLflow store);
- a reference (`--reference`), timed over the same steps the same way (a device sync at both
  ends of the timed region), in a plain script (`trainer.tools.plain_loop`):
  - `plain` (the default): the engine's own step, `for x, y in loader: step(x, y)`;
  - `hand`: the step as a user writes it, `for x, y in loader: optimizer.zero_grad();
    loss = model.loss(x, y); loss.backward(); optimizer.step()`, and under
    `engine.cuda_graph=true` a graph captured by hand as PyTorch's docs show;
  - `both`: each variant against each of them, one row per reference.

Three ways to run them (`--method`):

- `rounds` (what `benchmarks/overhead.sh` runs): one warm process per side, started once for the
  whole table (`python -m trainer.tools.overhead --serve` runs `trainer.loop.run.run(cfg)`, what
  `python -m trainer` calls once Hydra has composed the config; `trainer.tools.plain_loop --serve`
  runs each reference, a plain script that imports no MLflow). Each process builds a dataset once
  and keeps it for every run of the same `dataset` config; every run builds its own loader, model
  and optimizer, as a fresh process does. A round asks each side for one run of the same config,
  one process at a time (no two sides ever share the GPU or the host's cores), the side that goes
  first rotating from round to round; a run's timed region lasts about `--turn-ms` (its steps are
  set from the first round, whose runs are short), so the sides of a round draw from the same few
  seconds of a host whose speed drifts. The interval is over the rounds' ratios. Right for eager
  and graphed steps alike, and the whole table, every strategy eager and graphed against both
  references, fits a few minutes.
- `pairs`: one process after the other, the side that goes first alternating from pair to pair
  (engine, plain; plain, engine; ...); each side's ms/step over its timed steps. Right for a
  GPU-bound step (a CUDA graph), whose speed does not depend on the host's.
- `turns`: both at once, taking turns of `--turn-ms` from where their timed regions begin
  (`trainer.tools.turns`), each side's ms/step over the steps that ran inside its own turns.
  A host-bound step (eager, or fed by a DataLoader) runs as fast as the host's thread, and on a
  shared cloud host that speed swings by up to 2× from one second to the next: in pairs of
  processes a minute apart that is up to 25% of noise per pair, in turns a tenth of a second
  apart both sides draw from the same seconds. Not for a GPU-bound step: the GPU work one side
  leaves queued at a switch can outlast the other's turn.
- `auto` (the default): `turns` for an eager step, `pairs` for a CUDA-graphed one (fresh processes).

It prints each repeat's ratio (engine ÷ reference: 1.00 means the engine adds nothing) and, per
variant, the medians and a 95% interval of the ratio (whether the measurements tell it apart
from 1: over the pairs' ratios, or over adjacent turns' ratios), with the host's minor page
faults and CPU time per step on each side. Any override works (`model=noop`,
`engine.device=cpu`, `experiment=bench_strategies` for the reference workload).
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

from trainer.tools import turns as turns_
from trainer.tools.compose import compose_config

GRAPH = {"eager": ["false"], "graphed": ["true"], "both": ["false", "true"]}
REFERENCE = {"plain": ["plain"], "hand": ["hand"], "both": ["plain", "hand"]}
# Each reference's name in the table, and the plain loop's `--step` that runs it.
REFERENCE_NAME = {"plain": "plain loop, engine's step", "hand": "hand-written step"}
REFERENCE_STEP = {"plain": "engine", "hand": "hand"}
METHODS = ("auto", "pairs", "turns", "rounds")
QUICK = ["engine.progress=false"]


def _run(cmd: List[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed:\n{proc.stderr[-2000:]}")
    return proc


def _engine_cmd(overrides: List[str], tmp: Path) -> List[str]:
    return [sys.executable, "-m", "trainer", *overrides, f"tracking.uri=sqlite:///{tmp / 'overhead.db'}",
            "tracking.experiment=overhead", f"hydra.run.dir={tmp / 'hydra'}"]


def _latest_run(tmp: Path):
    from mlflow.tracking import MlflowClient  # here: the plain loop composes its config through this module
    client = MlflowClient(f"sqlite:///{tmp / 'overhead.db'}")
    exp = client.get_experiment_by_name("overhead")
    (latest,) = client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
    return client, latest


def engine_run(overrides: List[str], tmp: Path) -> Dict[str, float]:
    """One `python -m trainer` run; its summary read back from MLflow."""
    _run(_engine_cmd(overrides, tmp), tmp)
    return _latest_run(tmp)[1].data.metrics


def _plain_cmd(overrides: List[str], reference: str) -> List[str]:
    return [sys.executable, "-m", "trainer.tools.plain_loop", "--step", REFERENCE_STEP[reference], *overrides]


def plain_run(overrides: List[str], tmp: Path, reference: str = "plain") -> Dict[str, float]:
    """One run of the reference's plain loop; its figures."""
    proc = _run(_plain_cmd(overrides, reference), tmp)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def turns_run(overrides: List[str], tmp: Path, first: str, turn_s: float, settle_s: float,
              reference: str = "plain") -> Dict[str, float]:
    """`python -m trainer` and the reference's plain loop at once, taking turns (`trainer.tools.turns`);
    `first`: the side whose turn comes first. Both sides' figures over the steps of their turns."""
    import numpy as np
    clock = tmp / "plain_clock.npy"
    cmds = {"engine": _engine_cmd(overrides, tmp), "plain": [*_plain_cmd(overrides, reference), "--clock", str(clock)]}
    order = [first, "plain" if first == "engine" else "engine"]
    logs = [tmp / f"{side}.log" for side in order]
    try:
        turns = turns_.take_turns([cmds[side] for side in order], logs, tmp, turn_s)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    client, run = _latest_run(tmp)
    engine = dict(run.data.metrics)
    steps = _steps_csv(client, run.info.run_id, tmp)
    timed = steps[len(steps) - int(engine.get("timed_steps", 0)):]
    plain = json.loads(logs[order.index("plain")].read_text().strip().splitlines()[-1])
    starts = {"engine": np.array([float(r["host_clock_s"]) for r in timed]), "plain": np.load(clock)}
    rates = turns_.turn_rates([starts[side] for side in order], turns, settle_s)
    ms = dict(zip(order, rates["ms_per_step"]))
    counted = dict(zip(order, rates["steps"]))
    if not all(counted.values()):
        raise SystemExit("error: no step ran inside a turn: raise engine.max_steps (each side needs several "
                         f"turns of {turn_s * 1e3:.0f} ms of timed steps) or lower --turn-ms")
    # turn_rates gives the second side over the first, turn by turn: as engine ÷ plain
    pair_ratios = [r if order[1] == "engine" else 1 / r for r in rates["pair_ratios"]]
    engine["ms_per_step"] = ms["engine"]  # its own figure counts the time it spent stopped
    plain["plain_ms_per_step"] = ms["plain"]
    return {"engine": engine, "plain": plain, "pair_ratios": pair_ratios, "counted": counted,
            "turns": rates["turns"]}


def _steps_csv(client, run_id: str, tmp: Path) -> List[dict]:
    import csv
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(dir=tmp) as where:
        with open(client.download_artifacts(run_id, "steps.csv", where), newline="") as f:
            return list(csv.DictReader(f))


def measure(overrides: List[str], repeats: int, tmp: Path, log=print, reference: str = "plain") -> Dict[str, float]:
    """`repeats` alternating engine/reference pairs for one variant; medians and per-pair ratios."""
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
                plain.append(plain_run(overrides, tmp, reference))
            seconds[side] = time.perf_counter() - t0
        e, p = engine[-1]["ms_per_step"], plain[-1]["plain_ms_per_step"]
        log(f"  repeat {r + 1}: engine {e:.3f} ms/step, {reference} {p:.3f} ms/step, ratio {e / p:.3f} "
            f"(processes: engine {seconds['engine']:.0f} s, {reference} {seconds['plain']:.0f} s)")
    ratios = [e["ms_per_step"] / p["plain_ms_per_step"] for e, p in zip(engine, plain)]
    return _summary("pairs", reference, engine, plain, ratios)


def measure_turns(overrides: List[str], repeats: int, tmp: Path, turn_s: float = 0.1, settle_s: float = 0.02,
                  log=print, reference: str = "plain") -> Dict[str, float]:
    """`repeats` runs of the engine and the reference taking turns; the interval is over the
    ratios of adjacent turns, from every repeat."""
    engine, plain, pairs = [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        got = turns_run(overrides, tmp, "engine" if r % 2 == 0 else "plain", turn_s, settle_s, reference)
        engine.append(got["engine"])
        plain.append(got["plain"])
        pairs += got["pair_ratios"]
        e, p = engine[-1]["ms_per_step"], plain[-1]["plain_ms_per_step"]
        log(f"  repeat {r + 1}: engine {e:.3f} ms/step, {reference} {p:.3f} ms/step, ratio {e / p:.3f} "
            f"(turns of {turn_s * 1e3:.0f} ms: {got['turns']} counted, steps engine {got['counted']['engine']}, "
            f"{reference} {got['counted']['plain']}; {time.perf_counter() - t0:.0f} s)")
    ratios = [e["ms_per_step"] / p["plain_ms_per_step"] for e, p in zip(engine, plain)]
    return _summary("turns", reference, engine, plain, ratios, pairs)


# -- rounds: warm processes, every side in every process in turn ----------------------------------
ANSWER = "@overhead "  # a worker's answer line on its stdout (anything else it prints is left alone)


def serve() -> None:
    """A worker of `--method rounds` (`python -m trainer.tools.overhead --serve`): for each line on
    stdin, `{"side": "engine" | "plain" | "hand", "overrides": [...]}`, compose the config, build its dataset (or
    reuse the last one, when `cfg.dataset` is the same), run that side once and answer one line:
    `ANSWER` and its figures as JSON, or `{"error": the one-line reason}`."""
    from datasets import BuiltOnce
    from trainer.loop.run import run
    from trainer.tools.plain_loop import measure
    built = BuiltOnce()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            cfg = compose_config(request["overrides"])
            dataset = built(cfg.dataset)
            side = request["side"]
            if side == "engine":  # what `python -m trainer` calls once Hydra has composed the config
                got = run(cfg, dataset=dataset)
            else:  # the reference's plain loop, as `python -m trainer.tools.plain_loop --step ...` runs it
                got = measure(cfg, step=REFERENCE_STEP[side], dataset=dataset)
        except SystemExit as e:  # compose_config's one line
            got = {"error": str(e).removeprefix("error: ")}
        except Exception as e:
            got = {"error": " ".join(f"{type(e).__name__}: {e}".split())}
        print(ANSWER + json.dumps(got), flush=True)


class Worker:
    """One warm process of `--method rounds`, answering one request at a time (`serve`)."""

    def __init__(self, name: str, tmp: Path):
        self.name, self.log_path = name, tmp / f"{name}.log"
        # It runs in `tmp` (whatever it writes stays there) and imports the feedbench this process runs.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "trainer.tools.overhead", "--serve"]
        with open(self.log_path, "w") as log:  # its stderr, for the reason when it fails
            self.proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path))

    def ask(self, side: str, overrides: List[str]) -> Dict[str, float]:
        """One run of `side` on `overrides`; its figures."""
        self.send(side, overrides)
        return self.answer(side, overrides)

    def send(self, side: str, overrides: List[str]) -> None:
        """Ask for one run of `side` on `overrides`, without waiting for it (`answer` reads it)."""
        try:
            self.proc.stdin.write(json.dumps({"side": side, "overrides": overrides}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it has ended: `answer` says so

    def answer(self, side: str, overrides: List[str]) -> Dict[str, float]:
        """The figures of the run `send` asked for."""
        for line in self.proc.stdout:
            if line.startswith(ANSWER):
                got = json.loads(line[len(ANSWER):])
                if "error" in got:
                    variant = " ".join(o for o in overrides if o.startswith(("loader=", "engine.cuda_graph=")))
                    raise SystemExit(f"error: {side}, {variant}: {got['error']}")
                return got
        tail = self.log_path.read_text().strip().splitlines()[-5:]
        raise SystemExit(f"error: the {self.name} process ended (exit {self.proc.wait()}):\n" + "\n".join(tail))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # its loop ends at the end of its input
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def plan_round(r: int, sides: Sequence[str]) -> List[tuple]:
    """Round `r`'s runs, in order, as (side, worker index): the first side rotates by one a round
    and each side moves on to the next worker, so over `len(sides)` rounds every side has gone
    first, last and between, and run in every worker process once (a process placed on a slower
    core, or with a worse heap, then weighs on every side alike)."""
    n = len(sides)
    return [(sides[(r + k) % n], (2 * r + k) % n) for k in range(n)]  # side i = (r + k) % n on worker (i + r) % n


def measure_rounds(workers: List[Worker], overrides: List[str], references: Sequence[str], rounds: int,
                   turn_s: float, warmup: int, tight: float = 0.02, log=print) -> List[Dict[str, float]]:
    """Rounds of one run per side (`plan_round`), at most `rounds`: they stop once every ratio's 95%
    interval lies within `tight` of its middle (a GPU-bound step gets there in a few rounds, a
    host-bound one seldom), and never before each side has run in every worker. The first round's
    runs are short (30 timed steps); the next ones last about `turn_s`, from the first round's
    reference. One summary per reference, its ratios per round."""
    sides = ["engine", *references]
    got = {side: [] for side in sides}
    steps = warmup + 30
    for r in range(rounds):
        if r >= len(sides) and all(_tight(got["engine"], got[ref], tight) for ref in references):
            break
        took = {}
        for side, w in plan_round(r, sides):
            t0 = time.perf_counter()
            got[side].append(workers[w].ask(side, [*overrides, f"engine.max_steps={steps}"]))
            took[side] = time.perf_counter() - t0
        e = got["engine"][-1]["ms_per_step"]
        refs = ", ".join(f"{ref} {got[ref][-1]['plain_ms_per_step']:.3f} ({e / got[ref][-1]['plain_ms_per_step']:.3f})"
                         for ref in references)
        log(f"  round {r + 1}: engine {e:.3f} ms/step, {refs}; {steps - warmup} timed steps a run, "
            f"runs of {' '.join(f'{took[s]:.1f}' for s in sides)} s")
        if r == 0:  # every later run times about `turn_s`, at least 30 steps
            steps = warmup + max(30, round(turn_s * 1e3 / got[references[0]][0]["plain_ms_per_step"]))
    out = []
    for ref in references:
        ratios = [e["ms_per_step"] / p["plain_ms_per_step"] for e, p in zip(got["engine"], got[ref])]
        out.append(_summary("rounds", ref, got["engine"], got[ref], ratios))
    return out


def _tight(engine: List[dict], reference: List[dict], tight: float) -> bool:
    """Whether the 95% interval of engine ÷ reference over these runs lies within `tight` of its middle."""
    low, high = ratio_interval([e["ms_per_step"] / p["plain_ms_per_step"] for e, p in zip(engine, reference)])
    return math.sqrt(high / low) - 1 <= tight  # nan (one run) compares False


def _summary(method: str, reference: str, engine: List[dict], plain: List[dict], ratios: List[float],
             interval_from: Sequence[float] = ()) -> Dict[str, float]:
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    low, high = ratio_interval(list(interval_from) or ratios)
    return {"method": method, "reference": reference, "engine_ms": med(engine, "ms_per_step"), "plain_ms": med(plain, "plain_ms_per_step"),
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
    head = ("| loader | CUDA graph | method | reference | engine ms/step | reference ms/step "
            "| engine ÷ reference (min–max) | 95% interval | engine max/min | page faults/step engine / reference "
            "| host CPU ms/step engine / reference |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"| `{r['loader']}` | {'yes' if r['graph'] == 'true' else 'no'} | {r['method']} "
             f"| {REFERENCE_NAME[r['reference']]} "
             f"| {r['engine_ms']:.3f} | {r['plain_ms']:.3f} "
             f"| {r['ratio']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | {_interval(r)} | {r['engine_spread']:.2f} "
             f"| {r['engine_faults']:.0f} / {r['plain_faults']:.0f} | {r['engine_cpu_ms']:.2f} / {r['plain_cpu_ms']:.2f} |"
             for r in rows]
    return "\n".join([head, *lines])


def _interval(row: dict) -> str:
    low, high = row["ratio_ci_low"], row["ratio_ci_high"]
    return "–" if math.isnan(low) else f"{low:.2f}–{high:.2f}"


def add_comparison_args(p: argparse.ArgumentParser, repeats: int, what: str) -> None:
    """The options every comparison of two processes takes (`trainer.overhead`, `trainer.versus`)."""
    p.add_argument("--repeats", type=int, default=repeats, help=what)
    p.add_argument("--method", choices=METHODS, default="auto",
                   help="pairs: one process after the other; turns: both at once, taking turns; auto: turns when eager")
    p.add_argument("--turn-ms", type=float, default=100.0, help="length of a turn (--method turns)")
    p.add_argument("--settle-ms", type=float, default=20.0,
                   help="steps this soon after a turn begins are not counted (--method turns)")
    p.add_argument("--graph", choices=sorted(GRAPH), default="eager", help="time the eager step, the graphed one, or both")
    p.add_argument("--markdown", help="also write the table to this file")


def check_comparison_args(args) -> None:
    """One line naming the option and the fix for a bad value of those options."""
    if args.repeats < 1:
        raise SystemExit(f"error: --repeats must be >= 1 (got {args.repeats}): use --repeats 3")
    if not 0 <= args.settle_ms < args.turn_ms:
        raise SystemExit(f"error: --settle-ms must be >= 0 and below --turn-ms (got {args.settle_ms:g} and "
                         f"{args.turn_ms:g}): use --turn-ms 100 --settle-ms 20")


def resolve_method(method: str, graph: str) -> str:
    """`auto`: turns for an eager step (host-bound), pairs for a CUDA-graphed one (GPU-bound)."""
    return method if method != "auto" else ("turns" if graph == "false" else "pairs")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_comparison_args(p, repeats=3, what="engine/reference pairs (or turn-taking runs) per variant")
    p.add_argument("--loaders", default="", help="comma-separated strategies, or all (default: the composed one)")
    p.add_argument("--reference", choices=sorted(REFERENCE), default="plain",
                   help="plain: the engine's step in a plain loop; hand: the step as a user writes it; both")
    p.add_argument("--tight", type=float, default=0.02,
                   help="--method rounds: a row stops before --repeats rounds once its intervals are within this of their middle")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a worker of --method rounds
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=noop engine.device=cpu")
    args = p.parse_args(argv)
    if args.serve:
        return serve()
    check_comparison_args(args)
    base = QUICK + args.overrides
    cfg = compose_config(base)  # fail here, once, on a bad override
    loaders = [s for s in args.loaders.split(",") if s] or [cfg.loader.name]
    if args.loaders == "all":  # every strategy that feeds the workload's dataset (an image folder's: gpu_decode too)
        from trainer.loaders import LOADERS, for_any_dataset
        loaders = list(LOADERS) if cfg.dataset.name == "image_folder" else for_any_dataset()
    t0, rows = time.perf_counter(), []
    try:
        if args.method == "rounds":
            _main_rounds(args, base, loaders, cfg.engine.warmup_steps, rows)
        else:
            _main_processes(args, base, loaders, rows)
    except KeyboardInterrupt:  # a time limit's SIGINT: the rows done are the table
        print(table(rows))
        print(f"stopped after {time.perf_counter() - t0:.0f} s, {len(rows)} rows done", file=sys.stderr)
        raise SystemExit(130) from None
    print(table(rows))
    print(f"total: {time.perf_counter() - t0:.0f} s")


def _main_rounds(args, base: List[str], loaders: List[str], warmup: int, rows: List[dict]) -> None:
    """Every variant in rounds, over one set of warm processes; the table written as rows come in."""
    references = REFERENCE[args.reference]
    # The engine's records go to a throw-away store; nothing but the timed loop is compared, so the
    # kernel window (steps traced after the timed region) is left out, and the summary unprinted.
    quiet = ["engine.quiet=true", "engine.kernel_window_steps=0", "tracking.experiment=overhead"]
    with tempfile.TemporaryDirectory(prefix="feedbench-overhead-") as tmp:
        workers = [Worker(f"worker{i}", Path(tmp)) for i in range(1 + len(references))]
        try:
            # A first run in every worker at once, timed by nobody: a process's first steps on the GPU
            # load kernels and libraries that later runs find loaded.
            burn_in = [*base, *quiet, f"loader={loaders[0]}", f"engine.max_steps={warmup + 30}"]
            for worker in workers:
                worker.send(references[0], burn_in)
            for worker in workers:
                worker.answer(references[0], burn_in)
            for loader in loaders:
                for graph in GRAPH[args.graph]:
                    print(f"loader={loader} engine.cuda_graph={graph}", flush=True)
                    overrides = [*base, *quiet, f"tracking.uri=sqlite:///{Path(tmp) / 'overhead.db'}",
                                 f"loader={loader}", f"engine.cuda_graph={graph}"]
                    for got in measure_rounds(workers, overrides, references, args.repeats, args.turn_ms / 1e3, warmup,
                                              args.tight):
                        rows.append({"loader": loader, "graph": graph, **got})
                    if args.markdown:  # as it goes: a run stopped at its time limit keeps its rows
                        Path(args.markdown).write_text(table(rows) + "\n")
        finally:
            for worker in workers:
                worker.close()


def _main_processes(args, base: List[str], loaders: List[str], rows: List[dict]) -> None:
    """Every variant in fresh processes, in pairs or in turns."""
    with tempfile.TemporaryDirectory(prefix="feedbench-overhead-") as tmp:
        for loader in loaders:
            for graph in GRAPH[args.graph]:
                for reference in REFERENCE[args.reference]:
                    overrides = [*base, f"loader={loader}", f"engine.cuda_graph={graph}"]
                    print(f"loader={loader} engine.cuda_graph={graph} reference={reference}", flush=True)
                    if resolve_method(args.method, graph) == "turns":
                        got = measure_turns(overrides, args.repeats, Path(tmp), args.turn_ms / 1e3,
                                            args.settle_ms / 1e3, reference=reference)
                    else:
                        got = measure(overrides, args.repeats, Path(tmp), reference=reference)
                    rows.append({"loader": loader, "graph": graph, **got})
    if args.markdown:
        Path(args.markdown).write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
