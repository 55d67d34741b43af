"""`python -m trainer.tools.scaling`: one table of a preset's sweeps at several GPU counts.

Each torchrun launch of a sweep (`torchrun --nproc_per_node=N -m trainer -m experiment=multi_gpu`)
is one MLflow parent run tagged `world_size=N`. This reads the latest sweep of each world size in
an experiment and lines up every job (strategy, model, step) across them:

- *step*: how the job's step ran, eager or as a CUDA graph, and how its ranks averaged the
  gradients (`distributed.sync`: ddp; allreduce, one all-reduce of a flat buffer; sharded, a
  reduce-scatter, each rank updating its slice of the weights, and an all-gather; sharded by
  copy, the same slices moved by the copy engines, `distributed.exchange=copy`). One GPU
  exchanges nothing: a job without a one-GPU run of its own is compared with the one-GPU run of
  the same strategy, model and step under another sync;

- *samples/s*: all ranks' samples over the timed region; *× 1 GPU* that over the same job on one
  GPU, and *efficiency* that over N (1.00 = perfect scaling);
- *copy GB/s*: the ranks' copy bandwidths added (`aggregate_h2d_GBps`); *× 1 GPU* likewise;
- *ceiling GB/s*: every rank copying pinned batches at once (`aggregate_h2d_peak_pinned_GBps`;
  on one GPU: `h2d_peak_pinned_GBps`), and *of ceiling* the copy bandwidth over it;
- *ms/step*: the timed region's wall time per step (`ms_per_step`, the mean over the ranks), what
  a step costs whether the host or the GPU sets its pace (the host's own median step,
  `median_step_ms`, is a graph's launch alone when the GPU sets it), and *all-reduce ms*: one
  step's exchange of the gradients measured alone after the loop (`grad_allreduce_ms`): a step
  that grows from one GPU to several by about that much is bound by the exchange, not by its feed;
- *data wait* and *stream span* (`compute_stream_span_fraction`): means over the ranks; *overlap*: jobs timed at the same time on a
  shared device (their figures are not to be trusted);
- *run MiB/rank*: the host memory each rank's run took, its dataset, loader and model
  (`run_host_pss_mb`: its proportional share as its loop ended less the process's before the run;
  the mean over the ranks; a host copy of the dataset the ranks share is divided among them), and
  *… own copies*: the same job run with a copy of the dataset per rank
  (`loader.shared_host_copy=false`), from the experiment `<experiment>_own_copies` where it exists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from trainer.errors import ConfigError
from trainer.tracking import report

COLUMNS = ("loader", "model", "step", "gpus", "status", "samples/s", "× 1 GPU", "efficiency", "copy GB/s", "copy × 1 GPU",
           "ceiling GB/s", "of ceiling", "ms/step", "all-reduce ms", "data wait", "stream span", "run MiB/rank", "… own copies",
           "overlap")
NUMERIC = set(COLUMNS[5:18])
RUN_MB = "run_host_pss_mb"
OWN_COPIES = "_own_copies"  # the experiment of the same jobs with a copy of the dataset per rank: `<experiment>_own_copies`


def latest_sweeps(client: MlflowClient, experiment: str, required: bool = True) -> Dict[int, Run]:
    """world size -> the newest sweep (parent run) launched with it, in `experiment` (none there:
    an error, or {} when not `required`)."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None and not required:
        return {}
    if exp is None:
        raise ConfigError(f"no experiment {experiment!r} in this store: run `bash benchmarks/multi_gpu.sh` first or pass --experiment")
    parents = client.search_runs([exp.experiment_id], filter_string="tags.sweep = 'true'",
                                 order_by=["attributes.start_time DESC"], max_results=1000)
    found: Dict[int, Run] = {}
    for p in parents:
        found.setdefault(int(p.data.tags.get("world_size", "1")), p)
    if not found:
        raise ConfigError(f"no sweep in experiment {experiment!r}: run `bash benchmarks/multi_gpu.sh` first")
    return dict(sorted(found.items()))


def _host_mb(client: MlflowClient, sweeps: Dict[int, Run]) -> Dict[tuple, float]:
    """(strategy, model, world size) -> host MiB per rank its run took (`run_host_pss_mb`), for the
    finished jobs of `sweeps`."""
    return {(r.data.params.get("loader.name", "?"), r.data.params.get("model.name", "?"), size): r.data.metrics[RUN_MB]
            for size, parent in sweeps.items() for r in report.children(client, parent)
            if r.info.status == "FINISHED" and RUN_MB in r.data.metrics}


def scaling_rows(client: MlflowClient, sweeps: Dict[int, Run], own: Dict[int, Run] = {}) -> List[Dict[str, object]]:
    """One row per (strategy, model, world size), grouped by job, against the one-GPU figures;
    `own`: the sweeps of the same jobs with a copy of the dataset per rank."""
    own_mb = _host_mb(client, own)
    jobs: Dict[tuple, Dict[int, Run]] = {}
    overlaps: Dict[str, List[str]] = {}
    for size, parent in sweeps.items():
        runs = report.children(client, parent)
        overlaps.update(report.overlapping(runs))
        for r in runs:
            jobs.setdefault((r.data.params.get("loader.name", "?"), r.data.params.get("model.name", "?"), step_kind(r)), {})[size] = r
    # alone, distributed.sync changes nothing: (strategy, model, eager or graph) -> a one-GPU run,
    # allreduce's where there is one (the run a sharded job's rows are documented against)
    alone: Dict[tuple, Run] = {}
    for (loader, model, kind), by_size in sorted(jobs.items(), key=lambda job: job[0][2].endswith(", allreduce")):
        if 1 in by_size:
            alone[loader, model, kind.split(",")[0]] = by_size[1]
    rows = []
    for (loader, model, kind), by_size in jobs.items():
        one = by_size.get(1) or alone.get((loader, model, kind.split(",")[0]))
        one_m = one.data.metrics if one is not None and one.info.status == "FINISHED" else {}
        for size, r in sorted(by_size.items()):
            m = r.data.metrics if r.info.status == "FINISHED" else {}
            thr, copy = m.get("throughput_samples_per_s"), m.get("aggregate_h2d_GBps", m.get("h2d_GBps"))
            ceiling = m.get("aggregate_h2d_peak_pinned_GBps", m.get("h2d_peak_pinned_GBps"))
            base_thr = one_m.get("throughput_samples_per_s")
            base_copy = one_m.get("aggregate_h2d_GBps", one_m.get("h2d_GBps"))
            speedup = thr / base_thr if thr and base_thr else None
            rows.append({"loader": loader, "model": model, "step": kind, "gpus": size, "status": r.info.status,
                         "samples/s": thr, "× 1 GPU": speedup, "efficiency": speedup / size if speedup else None,
                         "copy GB/s": copy, "copy × 1 GPU": copy / base_copy if copy and base_copy else None,
                         "ceiling GB/s": ceiling, "of ceiling": copy / ceiling if copy and ceiling else None,
                         "ms/step": m.get("ms_per_step"), "all-reduce ms": m.get("grad_allreduce_ms"),
                         "data wait": m.get("data_wait_fraction"), "stream span": m.get("compute_stream_span_fraction"),
                         "run MiB/rank": m.get(RUN_MB), "… own copies": own_mb.get((loader, model, size)),
                         "overlap": "yes" if overlaps.get(r.info.run_id) else ""})
    return rows


def step_kind(r: Run) -> str:
    """How a job's step ran and how its ranks averaged the gradients: `eager, ddp`, `graph, allreduce`,
    `graph, sharded by copy` (`engine.cuda_graph`, `distributed.sync`, `distributed.exchange`; a run
    from before distributed.sync existed: ddp)."""
    graphed = r.data.tags.get("cuda_graph", r.data.params.get("engine.cuda_graph", "false")).lower() == "true"
    sync = r.data.params.get("distributed.sync", "ddp")
    if sync == "sharded" and r.data.params.get("distributed.exchange", "nccl") == "copy":
        sync = "sharded by copy"
    return f"{'graph' if graphed else 'eager'}, {sync}"


def _cell(column: str, value) -> str:
    if value is None or value == "":
        return "–" if column in NUMERIC else ""
    if column in ("samples/s", "run MiB/rank", "… own copies"):
        return f"{value:,.0f}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def to_text(rows: Sequence[dict]) -> str:
    cells = [[_cell(c, r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(COLUMNS)]

    def line(values):
        return "  ".join(v.rjust(w) if c in NUMERIC else v.ljust(w) for v, w, c in zip(values, widths, COLUMNS)).rstrip()
    return "\n".join([line(COLUMNS), line(["-" * w for w in widths])] + [line(c) for c in cells])


def to_markdown(rows: Sequence[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---:" if c in NUMERIC else "---" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cell(c, r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.tools.scaling", description=__doc__.splitlines()[0])
    p.add_argument("--uri", help="MLflow tracking URI (default: the project's outputs/mlflow.db)")
    p.add_argument("--experiment", default="multi_gpu", help="the experiment holding the sweeps (default: multi_gpu)")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="also write the table as Markdown")
    args = p.parse_args(argv)
    try:
        client, uri = report.open_store(args.uri)
        sweeps = latest_sweeps(client, args.experiment)
        own = latest_sweeps(client, args.experiment + OWN_COPIES, required=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = scaling_rows(client, sweeps, own)
    print(f"{args.experiment}: sweeps at {', '.join(str(n) for n in sweeps)} GPU(s) in {uri}")
    print(to_text(rows))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
