"""Two configurations of `python -m trainer` against each other, on the same seconds of the machine.

    python -m trainer.versus --a loader=pinned_gather --b loader=pinned_chunk [--graph eager|graphed|both]
                             [--repeats 2] [--method auto|pairs|turns] [--turn-ms 100] [--markdown FILE]
                             [hydra overrides shared by both...]

A sweep runs its jobs one after another, each for a few seconds. When the step is host-bound
(eager, or fed by a DataLoader), the host's speed, which on a shared cloud machine swings by up to
2× from one second to the next, then lands in the ratio between two strategies as much as the
strategies do. This runs the two configurations as users run them (`python -m trainer`, each
recorded in a throw-away MLflow store) and, like `trainer.overhead`, either

- `turns`: both processes at once, taking turns of `--turn-ms` from where their timed regions
  begin (`trainer.tools.turns`), each side's ms/step over the steps inside its own turns; or
- `pairs`: one after the other, the side that goes first alternating from repeat to repeat;
- `auto` (the default): turns for an eager step, pairs for a CUDA-graphed one.

`--a` and `--b` (repeatable) are each side's own overrides, applied after the shared ones. It
prints each repeat's ratio (a ÷ b in ms/step: 1.15 means `a` takes 15% longer per step) and a 95%
interval, with both sides' page faults and CPU time per step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

import numpy as np

from trainer.tools import turns as turns_
from trainer.tools.compose import compose_config
from trainer.tools.overhead import (GRAPH, QUICK, _engine_cmd, _interval, _latest_run, _steps_csv,
                                    add_comparison_args, check_comparison_args, engine_run, ratio_interval,
                                    resolve_method)

SIDES = ("a", "b")


def turns_run(overrides: Dict[str, List[str]], tmp: Path, first: str, turn_s: float, settle_s: float) -> dict:
    """Both sides' `python -m trainer` at once, taking turns; `first` has the first turn."""
    order = [first, "b" if first == "a" else "a"]
    for side in order:
        (tmp / side).mkdir(exist_ok=True)  # a store and a Hydra folder each: the two write at once
    logs = [tmp / side / "run.log" for side in order]
    try:
        turns = turns_.take_turns([_engine_cmd(overrides[side], tmp / side) for side in order], logs, tmp, turn_s)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    metrics, starts = {}, []
    for side in order:
        client, run = _latest_run(tmp / side)
        metrics[side] = dict(run.data.metrics)
        steps = _steps_csv(client, run.info.run_id, tmp / side)
        timed = steps[len(steps) - int(metrics[side].get("timed_steps", 0)):]
        starts.append(np.array([float(r["host_clock_s"]) for r in timed]))
    rates = turns_.turn_rates(starts, turns, settle_s)
    if not all(rates["steps"]):
        raise SystemExit("error: no step ran inside a turn: raise engine.max_steps (each side needs several "
                         f"turns of {turn_s * 1e3:.0f} ms of timed steps) or lower --turn-ms")
    for side, ms in zip(order, rates["ms_per_step"]):
        metrics[side]["ms_per_step"] = ms  # the run's own figure counts the time it spent stopped
    # turn_rates gives the second side over the first, turn by turn: as a ÷ b
    pair_ratios = [r if order[1] == "a" else 1 / r for r in rates["pair_ratios"]]
    return {**metrics, "pair_ratios": pair_ratios, "turns": rates["turns"], "counted": dict(zip(order, rates["steps"]))}


def measure(overrides: Dict[str, List[str]], repeats: int, tmp: Path, method: str, turn_s: float = 0.1,
            settle_s: float = 0.02, log=print) -> dict:
    """`repeats` comparisons of the two sides; the first side alternates from repeat to repeat."""
    runs: Dict[str, List[dict]] = {"a": [], "b": []}
    pairs: List[float] = []
    for r in range(repeats):
        t0 = time.perf_counter()
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        if method == "turns":
            got = turns_run(overrides, tmp, order[0], turn_s, settle_s)
            pairs += got["pair_ratios"]
            how = f"turns of {turn_s * 1e3:.0f} ms: {got['turns']} counted, steps a {got['counted']['a']}, " \
                  f"b {got['counted']['b']}"
        else:
            got = {side: engine_run(overrides[side], tmp) for side in order}
            how = "one after the other"
        for side in SIDES:
            runs[side].append(got[side])
        a, b = runs["a"][-1]["ms_per_step"], runs["b"][-1]["ms_per_step"]
        log(f"  repeat {r + 1}: a {a:.3f} ms/step, b {b:.3f} ms/step, ratio {a / b:.3f} "
            f"({how}; {time.perf_counter() - t0:.0f} s)")
    ratios = [a["ms_per_step"] / b["ms_per_step"] for a, b in zip(runs["a"], runs["b"])]
    low, high = ratio_interval(pairs or ratios)
    med = lambda side, k: statistics.median(x[k] for x in runs[side])  # noqa: E731
    return {"method": method, "a_ms": med("a", "ms_per_step"), "b_ms": med("b", "ms_per_step"),
            "ratio": statistics.median(ratios), "ratios": ratios, "ratio_ci_low": low, "ratio_ci_high": high,
            **{f"{side}_{k}": med(side, f"host_{k}_per_step") for side in SIDES for k in ("page_faults", "cpu_ms")}}


def table(a: Sequence[str], b: Sequence[str], rows: List[dict]) -> str:
    head = ("| a | b | CUDA graph | method | a ms/step | b ms/step | a ÷ b (each repeat) | 95% interval "
            "| page faults/step a / b | host CPU ms/step a / b |\n|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    name = lambda o: " ".join(f"`{x}`" for x in o) or "(shared only)"  # noqa: E731
    lines = []
    for r in rows:
        each = ", ".join(f"{x:.3f}" for x in r["ratios"])
        lines.append(f"| {name(a)} | {name(b)} | {'yes' if r['graph'] == 'true' else 'no'} | {r['method']} "
                     f"| {r['a_ms']:.3f} | {r['b_ms']:.3f} | {each} | {_interval(r)} "
                     f"| {r['a_page_faults']:.0f} / {r['b_page_faults']:.0f} | {r['a_cpu_ms']:.2f} / {r['b_cpu_ms']:.2f} |")
    return "\n".join([head, *lines])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m trainer.versus", description=__doc__.split("\n")[0])
    p.add_argument("--a", action="append", default=[], metavar="OVERRIDE", help="side a's own override (repeatable)")
    p.add_argument("--b", action="append", default=[], metavar="OVERRIDE", help="side b's own override (repeatable)")
    add_comparison_args(p, repeats=2, what="comparisons per variant (the first side alternates)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides both sides share, e.g. experiment=bench_strategies")
    args = p.parse_args(argv)
    if not args.a and not args.b:
        raise SystemExit("error: --a and --b give nothing to compare: e.g. --a loader=pinned_gather --b loader=pinned_chunk")
    check_comparison_args(args)
    base = QUICK + args.overrides
    rows = []
    with tempfile.TemporaryDirectory(prefix="feedbench-versus-") as tmp:
        for graph in GRAPH[args.graph]:
            overrides = {side: [*base, f"engine.cuda_graph={graph}", *own] for side, own in zip(SIDES, (args.a, args.b))}
            for side in SIDES:
                compose_config(overrides[side])  # fail here, once, on a bad override
            method = resolve_method(args.method, graph)
            print(f"engine.cuda_graph={graph}: a = {' '.join(args.a)}, b = {' '.join(args.b)}", flush=True)
            rows.append({"graph": graph, **measure(overrides, args.repeats, Path(tmp), method,
                                                   args.turn_ms / 1e3, args.settle_ms / 1e3)})
    print(table(args.a, args.b, rows))
    if args.markdown:
        Path(args.markdown).write_text(table(args.a, args.b, rows) + "\n")


if __name__ == "__main__":
    main()
