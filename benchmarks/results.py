"""Tables of docs/results.md, read from the latest sweep of each of its presets in MLflow.

    python benchmarks/results.py [--uri URI] [--update docs/results.md] [--images docs/results]

Prints one Markdown table per preset (and one of where each ran). `--update PAGE` writes each
table into PAGE between its `<!-- results:NAME -->` and `<!-- /results:NAME -->` lines and leaves
the prose alone; `--images DIR` copies each sweep's `comparison.png` to `DIR/<preset>.png` and
draws `DIR/limits_bandwidth.png`. Every number is a logged metric of one child run of the
preset's latest sweep (`python -m trainer -m experiment=<preset>`); ratios are between jobs of
that one sweep. The plain-loop columns are each job's reference, logged on its run by
`python -m trainer.report --plain` (the same config as a plain `for x, y in loader: step(x, y)`
script, in a fresh process): empty where it has not run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from trainer.tracking import report
from trainer.errors import ConfigError

os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded picture otherwise

PRESETS = ("limits", "copy_4gb", "iterable_chunk_loaders", "pin_memory_cifar", "mnist_mlp", "dataloader_grid", "lightning_vs_loop",
           "gpu_prefetch")
# What the public sources published (seconds), quoted in docs/results.md.
NOTEBOOK_LOADERS = {"copy_in_loader": 8.48, "pin_batches": 8.63, "no_pinning": 8.71, "pin_chunk": 9.64}
STACK_OVERFLOW = {("question", "pageable"): 6.5701503753662, ("question", "pinned_blocking"): 7.0254474401474,
                  ("answer", "pageable"): 5.72, ("answer", "pinned_async"): 5.48}
MNIST_NOTEBOOK = {("baseline", "0"): 42.71 / 5, ("pinned", "8"): 19.92 / 5}  # its two loaders (cpu_count()//2 workers); 5 epochs each
NOTEBOOK_LIGHTNING_S = 31.6  # trainer.fit: 30 epochs of 8 batches of 64 (240 steps)


# ----------------------------------------------------------------------------- reading runs
class Sweep:
    """The latest sweep of one preset: its parent run and its finished child runs."""

    def __init__(self, client: MlflowClient, preset: str):
        self.client, self.preset = client, preset
        self.parent = report.find_parent(client, experiment=preset)
        self.runs = [r for r in report.children(client, self.parent) if r.info.status == "FINISHED"]

    def find(self, **params: str) -> Optional[Run]:
        """The finished run whose params equal `params` (`__` stands for `.`: loader__name="pinned")."""
        for r in self.runs:
            if all(r.data.params.get(k.replace("__", ".")) == v for k, v in params.items()):
                return r
        return None

    def environment(self) -> dict:
        run = self.runs[0] if self.runs else None
        if run is None:
            return {}
        with tempfile.TemporaryDirectory() as tmp:
            try:
                return json.loads(Path(self.client.download_artifacts(run.info.run_id, "environment.json", tmp)).read_text())
            except Exception:  # an artifact that did not get written: say nothing rather than guess
                return {}


def m(run: Optional[Run], key: str) -> Optional[float]:
    return run.data.metrics.get(key) if run is not None else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a - b if a is not None and b is not None else None


def vs_plain(run: Optional[Run]) -> Optional[float]:
    """The job's ms/step over its plain loop's (`python -m trainer.report --plain` logs
    `plain_ms_per_step`, timed after the job; records made before that logged the ratio itself)."""
    return ratio(m(run, "ms_per_step"), m(run, "plain_ms_per_step")) or m(run, "engine_vs_plain")


def plain_rate(run: Optional[Run]) -> Optional[float]:
    """The job's samples/s in its plain loop: the same steps over the same loader, so the engine's
    samples/s times engine ÷ plain."""
    rate, ratio_ = m(run, "throughput_samples_per_s"), vs_plain(run)
    return rate * ratio_ if rate is not None and ratio_ is not None else None


def plain_time(seconds: Optional[float], run: Optional[Run]) -> Optional[float]:
    """A duration the engine measured, as the job's plain loop took it."""
    return ratio(seconds, vs_plain(run))


def cell(value, fmt: str = "{:.2f}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int = 1) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i >= numeric_from else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


# ----------------------------------------------------------------------------- the tables
def environment_table(sweeps: Dict[str, Sweep]) -> str:
    rows = []
    for preset, sweep in sweeps.items():
        env = sweep.environment()
        started = datetime.datetime.fromtimestamp(sweep.parent.info.start_time / 1000, datetime.timezone.utc)
        pcie = (f"Gen{env.get('pcie_gen_current', '?')} x{env.get('pcie_width_current', '?')} "
                f"(max Gen{env.get('pcie_gen_max', '?')} x{env.get('pcie_width_max', '?')})") if "pcie_gen_current" in env else ""
        rows.append([f"`{preset}`", started.strftime("%Y-%m-%d %H:%M UTC"), env.get("gpu_name") or "none: ran on the CPU", env.get("driver_version", ""),
                     f"{env.get('torch', '')} / CUDA {env.get('cuda', '')}", pcie,
                     f"{env.get('cpu', '')} ({env.get('cpu_count', '?')} threads)", str(env.get("git_commit") or "")[:10],
                     data_note(sweep)])
    return table(["preset", "date", "GPU", "driver", "torch / CUDA", "PCIe link", "CPU", "commit", "data"], rows, numeric_from=99)


def data_note(sweep: Sweep) -> str:
    run = sweep.runs[0] if sweep.runs else None
    if run is None or run.data.params.get("dataset.name") == "synthetic":
        return "synthetic (generated, seeded)"
    root = run.data.params.get("dataset.root", "")
    generated = "generated" in root or run.data.params.get("dataset.verify_md5") == "False"
    return "generated files of the real format and size (random pixels)" if generated else "torchvision's files"


def transfer_bytes(run: Run) -> int:
    """A `limits` job's batch in bytes (float32 samples; its int64 labels travel too, 8 bytes a sample)."""
    return int(run.data.params["loader.batch_size"]) * math.prod(json.loads(run.data.params["dataset.shape"])) * 4


def limits_table(sweep: Sweep) -> str:
    rows = []
    batches = sorted({int(r.data.params["loader.batch_size"]) for r in sweep.runs})
    for b in batches:
        pinned = sweep.find(loader__name="pinned_chunk", loader__batch_size=str(b))
        pageable = sweep.find(loader__name="baseline", loader__batch_size=str(b))
        peak_pinned, peak_pageable = m(pinned, "h2d_peak_pinned_GBps"), m(pageable, "h2d_peak_pageable_GBps")
        rows.append([size(transfer_bytes(pinned or pageable)), cell(peak_pinned), cell(peak_pageable),
                     cell(ratio(peak_pinned, peak_pageable)), cell(m(pinned, "h2d_GBps")), cell(m(pageable, "h2d_GBps")),
                     cell(vs_plain(pinned)), cell(vs_plain(pageable))])
    return table(["transfer", "pinned, alone (GB/s)", "pageable, alone (GB/s)", "pinned ÷ pageable",
                  "pinned, in the loop (`pinned_chunk`)", "pageable, in the loop (`baseline`)",
                  "`pinned_chunk` step: engine ÷ plain loop", "`baseline` step: engine ÷ plain loop"], rows)


def copy_table(sweep: Sweep) -> str:
    base, pinned, chunk = (sweep.find(loader__name=n) for n in ("baseline", "pinned", "pinned_chunk"))
    shape = json.loads((base or pinned or chunk).data.params["dataset.shape"])
    nbytes = int((base or pinned or chunk).data.params["dataset.num_samples"]) * math.prod(shape) * 4
    seconds = lambda gbps: nbytes / (gbps * 1e9) if gbps else None  # noqa: E731
    ms = lambda run, key: m(run, key) / 1e3 if m(run, key) is not None else None  # noqa: E731
    # `baseline`'s wait for a batch holds the same collate plus its blocking copy; `pinned`'s holds
    # the collate plus `pin_memory()` (its copy is only queued). Their difference, less that copy,
    # is what `pin_memory()` costs.
    steady_pin = diff(ms(pinned, "median_data_wait_ms"), diff(ms(base, "median_data_wait_ms"), ms(base, "median_h2d_ms")))
    rows = [
        ["pageable copy (s)", "3.6", cell(ms(base, "median_h2d_ms"), "{:.3f}"), cell(seconds(m(base, "h2d_peak_pageable_GBps")), "{:.3f}")],
        ["pageable copy (GB/s)", "1.1 (4 GB / 3.6 s)", cell(m(base, "h2d_GBps")), cell(m(base, "h2d_peak_pageable_GBps"))],
        ["`pin_memory()` of the tensor (s)", "4.58", cell(steady_pin, "{:.3f}") + " (page-locked block reused)", ""],
        ["pinned copy (s)", "0.3", cell(ms(pinned, "median_h2d_ms"), "{:.3f}"), cell(seconds(m(pinned, "h2d_peak_pinned_GBps")), "{:.3f}")],
        ["pinned copy (GB/s)", "13 (4 GB / 0.3 s)", cell(m(pinned, "h2d_GBps")), cell(m(pinned, "h2d_peak_pinned_GBps"))],
        ["pageable ÷ pinned copy time", "12", cell(ratio(m(base, "median_h2d_ms"), m(pinned, "median_h2d_ms")), "{:.1f}"),
         cell(ratio(m(pinned, "h2d_peak_pinned_GBps"), m(base, "h2d_peak_pageable_GBps")), "{:.1f}")],
        ["`pinned_chunk`: allocate page-locked + generate into it, once (s)", "", cell(m(chunk, "setup_s"), "{:.2f}"), ""],
        ["`pinned_chunk`: copy per step (s)", "", cell(ms(chunk, "median_h2d_ms"), "{:.3f}"), ""],
    ]
    for name, run in (("baseline", base), ("pinned", pinned), ("pinned_chunk", chunk)):
        step, plain = ms(run, "ms_per_step"), ms(run, "plain_ms_per_step")
        rows.append([f"`{name}`: step in the loop (s), engine / plain loop", "",
                     f"{cell(step, '{:.3f}')} / {cell(plain, '{:.3f}')}" if plain is not None else cell(step, "{:.3f}"), ""])
    return table(["4 GB (1000×1000×1000 float32)", "the notebook", "ours, in the loop", "ours, alone"], rows)


def loaders_table(sweep: Sweep) -> str:
    rows = []
    ref = {model: m(sweep.find(loader__variant="no_pinning", model__name=model), "throughput_samples_per_s")
           for model in ("autoencoder", "noop")}
    for variant, label in (("copy_in_loader", "numpy→CUDA inside the DataLoader"), ("pin_batches", "pinning batch by batch"),
                           ("no_pinning", "no pinning"), ("pin_chunk", "big chunk pinned, contiguous slices")):
        ae, noop = (sweep.find(loader__variant=variant, model__name=model) for model in ("autoencoder", "noop"))
        published = NOTEBOOK_LOADERS[variant]
        rows.append([f"{label} (`{variant}`)", f"{published:.2f}", f"{NOTEBOOK_LOADERS['no_pinning'] / published:.2f}",
                     cell(m(ae, "throughput_samples_per_s"), "{:,.0f}"), cell(plain_rate(ae), "{:,.0f}"),
                     cell(ratio(m(ae, "throughput_samples_per_s"), ref["autoencoder"])),
                     cell(m(ae, "data_wait_fraction")), cell(m(ae, "compute_stream_span_fraction")),
                     cell(m(noop, "throughput_samples_per_s"), "{:,.0f}"), cell(plain_rate(noop), "{:,.0f}"),
                     cell(ratio(m(noop, "throughput_samples_per_s"), ref["noop"]))])
    return table(["variant", "the notebook (s)", "the notebook: speed vs no pinning", "autoencoder samples/s", "plain loop samples/s",
                  "vs no pinning", "data wait", "stream span", "do-nothing model samples/s", "plain loop samples/s",
                  "vs no pinning"], rows)


def _case(run: Run) -> str:
    if run.data.params.get("loader.name") == "baseline":
        return "pageable"
    return "pinned_async" if run.data.params.get("loader.non_blocking") == "True" else "pinned_blocking"


CASES = {"pageable": "pin_memory off", "pinned_blocking": "pin_memory on, blocking copy", "pinned_async": "pin_memory on, non_blocking"}


def pin_memory_cifar_table(sweep: Sweep) -> str:
    rows = []
    for setting, batch in (("question", "64"), ("answer", "1024")):
        runs = {_case(r): r for r in sweep.runs if r.data.params.get("loader.batch_size") == batch}
        ref = m(runs.get("pageable"), "throughput_samples_per_s")
        for case in CASES:
            r = runs.get(case)
            epoch = ratio(m(r, "total_samples"), m(r, "throughput_samples_per_s"))
            published = STACK_OVERFLOW.get((setting, case))
            rows.append([setting, CASES[case], cell(published, "{:.2f}"), cell(epoch), cell(plain_time(epoch, r)),
                         cell(m(r, "throughput_samples_per_s"), "{:,.0f}"),
                         cell(ratio(m(r, "throughput_samples_per_s"), ref)), cell(m(r, "data_wait_fraction")), cell(m(r, "h2d_GBps"))])
    return table(["setting", "pin_memory / copy", "Stack Overflow (s per epoch)", "ours (s per epoch)", "plain loop (s per epoch)", "samples/s",
                  "vs pin_memory off", "data wait", "copy GB/s"], rows, numeric_from=2)


def mnist_mlp_table(sweep: Sweep) -> str:
    rows = []
    ref = m(sweep.find(loader__name="baseline", loader__num_workers="0"), "throughput_samples_per_s")
    for r in sweep.runs:
        name, workers = r.data.params["loader.name"], r.data.params["loader.num_workers"]
        published = MNIST_NOTEBOOK.get((name, workers))
        label = {("baseline", "0"): " (the notebook's first loader)", ("pinned", "8"): " (its second)"}.get((name, workers), "")
        rows.append([f"`{name}`{label}", workers, cell(published), cell(m(r, "timed_wall_s")), cell(plain_time(m(r, "timed_wall_s"), r)),
                     cell(m(r, "throughput_samples_per_s"), "{:,.0f}"), cell(ratio(m(r, "throughput_samples_per_s"), ref)),
                     cell(m(r, "data_wait_fraction")), cell(m(r, "compute_stream_span_fraction"))])
    return table(["loader", "workers", "the notebook (s per epoch)", "ours: epoch 2 (s)", "plain loop: epoch 2 (s)", "samples/s", "vs the first loader",
                  "data wait", "stream span"], rows, numeric_from=2)


def dataloader_grid_table(sweep: Sweep) -> str:
    rows = []
    ref = m(next((r for r in sweep.runs if _case(r) == "pageable" and r.data.params["loader.num_workers"] == "0"), None),
            "throughput_samples_per_s")
    for r in sorted(sweep.runs, key=lambda r: (list(CASES).index(_case(r)), int(r.data.params["loader.num_workers"]),
                                               r.data.params["loader.prefetch_factor"])):
        workers = r.data.params["loader.num_workers"]
        prefetch = r.data.params["loader.prefetch_factor"] + (" (unused)" if workers == "0" else "")
        rows.append([CASES[_case(r)], workers, prefetch, cell(m(r, "throughput_samples_per_s"), "{:,.0f}"), cell(plain_rate(r), "{:,.0f}"),
                     cell(ratio(m(r, "throughput_samples_per_s"), ref)), cell(m(r, "data_wait_fraction")),
                     cell(m(r, "compute_stream_span_fraction")), cell(m(r, "h2d_GBps"))])
    return table(["pin_memory / copy", "workers", "prefetch_factor", "samples/s", "plain loop samples/s", "vs pageable, 0 workers",
                  "data wait", "stream span", "copy GB/s"], rows, numeric_from=3)


LIGHTNING_STRATEGIES = {
    "iterable_chunks": "the notebook's own loader (`iterable_chunks`): Lightning copies",
    "pinned": "pin_memory DataLoader (`pinned`): Lightning copies",
    "prefetch": "`prefetch`: on the GPU already",
    "pinned_chunk": "`pinned_chunk`: on the GPU already",
    "gpu_resident": "`gpu_resident`: on the GPU already",
}


def pct(value: Optional[float]) -> str:
    return cell(100 * value, "{:+.1f} %") if value is not None else ""


def lightning_vs_loop_table(sweep: Sweep) -> str:
    ref = m(sweep.find(engine__loop="lightning", loader__name="iterable_chunks"), "throughput_samples_per_s")
    published_rate = 240 * 64 / NOTEBOOK_LIGHTNING_S
    rows = [["the notebook's run (Lightning 1.0.5, its GPU): the whole `trainer.fit`", cell(published_rate, "{:,.0f}"),
             cell(NOTEBOOK_LIGHTNING_S, "{:.1f}"), "", "", "", "", "", "", ""]]
    for strategy, label in LIGHTNING_STRATEGIES.items():
        theirs = sweep.find(engine__loop="lightning", loader__name=strategy)
        ours = sweep.find(engine__loop="feedbench", loader__name=strategy)
        rate = m(theirs, "throughput_samples_per_s")
        rows.append([label, cell(rate, "{:,.0f}"), cell(ratio(m(theirs, "total_samples"), rate), "{:.2f}"),
                     cell(ratio(rate, ref)), cell(m(theirs, "data_wait_fraction")), cell(m(theirs, "lightning_fraction"), "{:.3f}"),
                     cell(m(theirs, "median_lightning_ms"), "{:.3f}"), cell(m(ours, "throughput_samples_per_s"), "{:,.0f}"),
                     cell(plain_rate(ours) or plain_rate(theirs), "{:,.0f}"),  # one config, whichever loop ran it
                     pct(diff(ratio(m(ours, "throughput_samples_per_s"), rate), 1.0))])
    return table(["batches from", "in Lightning: samples/s", "240 steps (s)", "vs the notebook's loader in Lightning",
                  "data wait", "Lightning's share", "Lightning ms/step", "in our loop: samples/s",
                  "plain loop samples/s", "Lightning loop's cost (our loop faster by)"], rows)


def gpu_prefetch_table(sweep: Sweep) -> str:
    rows = []
    cases = (("lightning", "pinned", "Lightning's default loop (`pinned`)"),
             ("lightning", "prefetch", "Lightning + our side-stream prefetch"),
             ("feedbench", "pinned", "our loop, `pinned`"), ("feedbench", "prefetch", "our loop, `prefetch`"))
    for busy in ("0.0", "2.0"):
        ref = m(sweep.find(engine__loop="lightning", loader__name="pinned", model__busy_ms=busy), "throughput_samples_per_s")
        for loop, loader, label in cases:
            r = sweep.find(engine__loop=loop, loader__name=loader, model__busy_ms=busy)
            rows.append([f"autoencoder{' + 2 ms' if busy == '2.0' else ''}", label, cell(m(r, "throughput_samples_per_s"), "{:,.0f}"),
                         cell(plain_rate(r), "{:,.0f}"), cell(ratio(m(r, "throughput_samples_per_s"), ref)), cell(m(r, "median_step_ms"), "{:.3f}"),
                         cell(m(r, "median_h2d_ms"), "{:.3f}"), cell(m(r, "h2d_GBps")), cell(m(r, "h2d_beside_step_fraction")),
                         cell(m(r, "trace_h2d_overlap_fraction")), cell(m(r, "lightning_fraction"), "{:.3f}")])
    return table(["model", "loop", "samples/s", "plain loop samples/s", "vs Lightning's default", "step (ms)", "copy (ms)", "copy GB/s",
                  "copy beside step (events)", "copy during kernels (trace)", "Lightning's share"], rows, numeric_from=2)


TABLES: Dict[str, Callable[[Sweep], str]] = {"limits": limits_table, "copy_4gb": copy_table, "iterable_chunk_loaders": loaders_table,
                                             "pin_memory_cifar": pin_memory_cifar_table, "mnist_mlp": mnist_mlp_table,
                                             "dataloader_grid": dataloader_grid_table, "lightning_vs_loop": lightning_vs_loop_table,
                                             "gpu_prefetch": gpu_prefetch_table}


# ----------------------------------------------------------------------------- pictures and the page
def limits_plot(sweep: Sweep, path: Path) -> Path:
    """GB/s against transfer size: pinned and pageable, alone and in the loop."""
    series = {("pinned_chunk", "h2d_peak_pinned_GBps"): ("pinned, alone", "#1f77b4", "-"),
              ("baseline", "h2d_peak_pageable_GBps"): ("pageable, alone", "#d62728", "-"),
              ("pinned_chunk", "h2d_GBps"): ("pinned, in the loop", "#1f77b4", "--"),
              ("baseline", "h2d_GBps"): ("pageable, in the loop", "#d62728", "--")}
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for (loader, key), (label, colour, style) in series.items():
        points = sorted((transfer_bytes(r), r.data.metrics.get(key)) for r in sweep.runs
                        if r.data.params["loader.name"] == loader and key in r.data.metrics)
        if points:
            ax.plot(*zip(*points), style, color=colour, marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per transfer")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("host → device copy bandwidth")
    ax.legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def copy_images(sweeps: Dict[str, Sweep], folder: Path) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for preset, sweep in sweeps.items():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                png = Path(sweep.client.download_artifacts(sweep.parent.info.run_id, "comparison.png", tmp))
            except Exception:  # a sweep closed before it drew one
                continue
            written.append(Path(shutil.copy(png, folder / f"{preset}.png")))
    if "limits" in sweeps:
        written.append(limits_plot(sweeps["limits"], folder / "limits_bandwidth.png"))
    return written


def keep_other_presets(text: str, environment: str) -> str:
    """The environment table for a page updated from a store that holds only some presets' sweeps:
    the new rows, plus the page's rows of every preset the store had no sweep of, in preset order."""
    found = re.search(r"<!-- results:environment -->\n(.*?)\n<!-- /results:environment -->", text, re.S)
    preset = lambda row: row.split("|")[1].strip()  # noqa: E731  ("`limits`")
    rows = {preset(r): r for r in (found.group(1).splitlines() if found else []) if r.startswith("| `")}
    head, new = [], {}
    for row in environment.splitlines():
        if row.startswith("| `"):
            new[preset(row)] = row
        else:
            head.append(row)
    rows.update(new)
    order = {f"`{name}`": i for i, name in enumerate(PRESETS)}
    return "\n".join(head + sorted(rows.values(), key=lambda r: order.get(preset(r), len(order))))


def update_page(text: str, tables: Dict[str, str]) -> str:
    """Replace what stands between `<!-- results:NAME -->` and `<!-- /results:NAME -->` with table NAME."""
    for name, body in tables.items():
        pattern = re.compile(rf"(<!-- results:{re.escape(name)} -->\n).*?(\n<!-- /results:{re.escape(name)} -->)", re.S)
        if not pattern.search(text):
            raise ConfigError(f"the page has no '<!-- results:{name} -->' ... '<!-- /results:{name} -->' block for table {name}")
        text = pattern.sub(lambda found: found.group(1) + body + found.group(2), text)
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uri", help="MLflow tracking URI (default: the project's outputs/mlflow.db)")
    parser.add_argument("--update", type=Path, metavar="PAGE", help="write the tables into PAGE's results blocks")
    parser.add_argument("--images", type=Path, metavar="DIR", help="copy the comparison pictures and draw limits_bandwidth.png there")
    args = parser.parse_args(argv)
    try:
        client, uri = report.open_store(args.uri)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sweeps, tables = {}, {}
    for preset in PRESETS:
        try:
            sweeps[preset] = Sweep(client, preset)
        except ConfigError:
            print(f"{preset}: no sweep in {uri} (run `python -m trainer -m experiment={preset}`)", file=sys.stderr)
            continue
        tables[preset] = TABLES[preset](sweeps[preset])
    if sweeps:
        tables["environment"] = environment_table(sweeps)
    for name, body in tables.items():
        print(f"## {name}\n\n{body}\n")
    if args.update:
        page = args.update.read_text()
        if "environment" in tables:  # presets not in this store keep the page's row (and their own tables)
            tables["environment"] = keep_other_presets(page, tables["environment"])
        args.update.write_text(update_page(page, tables))
    if args.images:
        for path in copy_images(sweeps, args.images):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
