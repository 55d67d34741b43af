"""The advisor on the eight workloads of `advisor_workloads.py`, one after the other in this one
process (no interpreter, import or CUDA start per workload), each with `--verify` and its own time
limit, none started past `--deadline` seconds. Writes the table (rewritten after each workload) to
`--markdown`; `benchmarks/advisor.sh` runs it. With `--sweep FILE` (advisor_sweep.py's JSON), the
fastest row of the exhaustive sweep of each workload goes beside the advisor's best, and their
ratio: the one the sweep measured with the two in turns, where it did (`in_turns`), else the
ratio of the two calls' readings.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from advisor_workloads import ROOT, WORKLOADS, compose, ensure_data, time_limit

SHARED_GRID = WORKLOADS[0][0]  # the reference workload's sweep


def cell(v) -> str:
    return f"{v:.3f}" if v is not None and math.isfinite(v) else "—"


def off(measured, predicted) -> str:
    return f"{measured / predicted - 1:+.0%}" if measured and predicted and math.isfinite(measured / predicted) else "—"


def figures(result) -> dict:
    """One workload's advice as plain figures (kept as JSON: the table can be rendered again)."""
    from trainer.tools.advisor import cautioned, judge, miss_tolerance, model_miss
    lad, top, changes = result["ladder"], result["best"], result["changes"]
    first = changes[0] if changes else None
    return {"configured": lad.configured, "bound": result["bound"], "miss": model_miss(lad),
            "miss_tolerance": miss_tolerance(lad), "caution": cautioned(lad, judge(lad)),
            "best": " ".join(top.overrides) if top else "as configured", "chain": " → ".join(top.chain) if top else "—",
            "best_predicted": top.predicted_ms if top else None, "best_measured": top.measured_ms if top else None,
            "top": " ".join(first.overrides) if first else "none",
            "top_predicted": first.predicted_ms if first else None, "top_measured": first.measured_ms if first else None}


def table(done: list, gpu: str, sweep: dict) -> str:
    lines = [f"GPU: {gpu}", "",
             "| workload | configured ms/step | bound | model's miss (tolerance) | caution | best configuration | its bounds | "
             "predicted | measured | Δ | sweep's fastest | its ms/step | best ÷ fastest | top change | predicted | "
             "measured | Δ | advisor s |",
             "|---|---:|---|---:|---|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for row in done:
        label, f, took = row["label"], row.get("figures"), row["took"]
        # The reference workloads differ only in the loader and graph the sweep sets: one grid for
        # all (with 64 workers, its DataLoader rows are slower still: the configured run).
        grid = sweep.get(label) or (sweep.get(SHARED_GRID) if label.startswith("reference") else None) or {}
        fast = grid.get("fastest") or {}
        if f is None:
            lines.append(f"| {label} | — | — ({row['ended']}) |" + " — |" * 14 + f" {took:.0f} |")
            continue
        best_ms = f["best_measured"] if f["best_measured"] is not None else f["configured"]
        # (no verdict: no configuration was chosen, so there is nothing to hold against the sweep)
        ratio = (f"{best_ms / fast['ms_per_step']:.2f}" if fast.get("ms_per_step") and math.isfinite(best_ms)
                 and f["bound"] != "none" else "—")
        turns = grid.get("in_turns") or {}
        if sweep.get(label) and turns.get("best") == f["best"] and turns.get("ratio") is not None:
            # The two timed in turns in the sweep's process: the ratio that the host's drift between
            # the two calls does not move (the same job: 1 by construction).
            ratio = "1.00 (same job)" if turns.get("same_job") else f"{turns['ratio']:.2f} (in turns)"
        lines.append(
            f"| {label} | {cell(f['configured'])} | {f['bound']} | {f['miss']:+.0%} (±{f['miss_tolerance']:.0%}) | "
            f"{'yes' if f['caution'] else 'no'} | {f['best']} | {f['chain']} | {cell(f['best_predicted'])} | "
            f"{cell(f['best_measured'])} | {off(f['best_measured'], f['best_predicted'])} | {fast.get('overrides', '—')} | "
            f"{cell(fast.get('ms_per_step'))} | {ratio} | {f['top']} | {cell(f['top_predicted'])} | "
            f"{cell(f['top_measured'])} | {off(f['top_measured'], f['top_predicted'])} | {took:.0f} |")
    return "\n".join(lines) + "\n"


def write(done: list, gpu: str, sweep_path: Path, markdown: Path) -> None:
    sweep = json.loads(sweep_path.read_text()) if sweep_path.is_file() else {}
    markdown.write_text(table(done, gpu, sweep) + "\nHow each workload ended:\n\n" + "\n".join(
        f"- {r['label']}: {r['ended']} after {r['took']:.0f} s" for r in done) + "\n")
    markdown.with_suffix(".json").write_text(json.dumps({"gpu": gpu, "rows": done}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deadline", type=float, default=340, help="start no workload past this many seconds")
    p.add_argument("--store", default=str(ROOT / "outputs" / "advisor" / "mlflow.db"))
    p.add_argument("--markdown", default=str(ROOT / "outputs" / "advisor.md"))
    p.add_argument("--sweep", default=str(ROOT / "outputs" / "advisor_sweep.json"))
    p.add_argument("--only", default="", help="comma-separated workload numbers (1-8) to run, default all")
    p.add_argument("--render", action="store_true", help="run nothing: the table again from the last run's JSON "
                   "(beside --markdown) and the sweep's")
    args = p.parse_args()
    markdown, sweep_path = Path(args.markdown), Path(args.sweep)
    if args.render:
        last = json.loads(markdown.with_suffix(".json").read_text())
        write(last["rows"], last["gpu"], sweep_path, markdown)
        print(markdown.read_text())
        return 0
    start = time.perf_counter()
    import torch

    from trainer.tools.advisor import advise
    ensure_data()
    uri = f"sqlite:///{Path(args.store).resolve()}"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    chosen = {int(i) for i in args.only.split(",") if i} or set(range(1, len(WORKLOADS) + 1))
    if not chosen <= set(range(1, len(WORKLOADS) + 1)):
        p.error(f"--only: workload numbers are 1 to {len(WORKLOADS)}")
    done = []
    for number, (label, limit, steps, overrides) in enumerate(WORKLOADS, 1):
        if number not in chosen:
            continue
        left = args.deadline - (time.perf_counter() - start)
        if left < 15:
            done.append({"label": label, "took": 0.0, "ended": "not run: the deadline"})
            continue
        began, row, stop = time.perf_counter(), {"label": label}, None
        print(f"== {number}. {label} (--steps {steps}, at most {min(limit, left):.0f} s)", file=sys.stderr, flush=True)
        try:
            cfg = compose([*overrides, f"tracking.uri={uri}"])
            with time_limit(min(limit, left)) as stop:
                # No kernel windows: they feed no prediction, and the eight must fit one call.
                result = advise(cfg, steps, verify=True, overrides=overrides, kernels=False)
            row["figures"], row["ended"] = figures(result), "finished"
            print(result["text"], flush=True)
        except KeyboardInterrupt:
            if stop is None or not stop.fired:
                raise  # the user's Ctrl-C or an outside SIGTERM: the whole table stops
            row["ended"] = "stopped at its time limit (KILLED)"
        except Exception as e:  # one workload's failure is its row, not the table's end
            row["ended"] = f"failed: {' '.join(str(e).split())[:200]}"
        row["took"] = time.perf_counter() - began
        done.append(row)
        write(done, gpu, sweep_path, markdown)
    print(markdown.read_text())
    print(f"total: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
