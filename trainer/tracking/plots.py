"""Pictures of a run (`timeline.png`) and of a sweep (`comparison.png`), drawn after the fact.

Matplotlib's object API with the Agg canvas: no pyplot state, no display needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, List, Sequence

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# One colour per part of a step, the same in every picture.
COLOURS = {"data_wait_ms": "#d62728", "h2d_ms": "#ff7f0e", "compute_ms": "#1f77b4", "lightning_ms": "#9467bd",
           "throughput": "#2ca02c"}
PARTS = (("data_wait_ms", "data wait"), ("h2d_ms", "host→device copy"), ("compute_ms", "compute"),
         ("lightning_ms", "Lightning's own code"))  # the last only in runs of engine.loop=lightning


def _figure(**kwargs) -> Figure:
    # Matplotlib is imported when a picture is drawn: a command that fails early, or a run that
    # draws none, starts without it (0.4 s).
    from matplotlib.figure import Figure
    return Figure(**kwargs)


def _save(fig: Figure, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


MAX_BARS = 1000  # more steps than this are drawn as means over equal runs of steps


def _binned(rows: Sequence[dict]) -> tuple:
    """(edges, rows): one bar per step, or per run of `ceil(n / MAX_BARS)` steps (their means)."""
    size = math.ceil(len(rows) / MAX_BARS)
    groups = [rows[i:i + size] for i in range(0, len(rows), size)]
    edges = [int(g[0]["step"]) - 0.5 for g in groups] + [int(groups[-1][-1]["step"]) + 0.5]
    keys = [k for k, _ in PARTS if k in rows[0]] + ["step_ms", "samples"]
    return edges, [{k: _mean(float(r[k]) for r in g) for k in keys} for g in groups], size


def _mean(values) -> float:
    """Mean of the values that were measured (a step outside the GPU-timed runs has no GPU times:
    it is drawn with none)."""
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else 0.0


def timeline(rows: Sequence[dict], path: Path, warmup_steps: int = 0, title: str = "") -> Path:
    """Per-step stacked data wait / copy / compute (/ Lightning) (ms), the step's wall time and the throughput.

    Each part is one `stairs` polygon rather than one bar per step, and a long run is drawn as
    means over runs of steps: a picture of 100k steps stays cheap to draw.
    """
    edges, bars, size = _binned(rows)
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    fig = _figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.add_subplot()
    if warmup_steps > 0:
        ax.axvspan(0.5, min(warmup_steps, len(rows)) + 0.5, color="grey", alpha=0.15, label="warm-up (not in summaries)")
    base = [0.0] * len(bars)
    for key, label in [(k, label) for k, label in PARTS if k in bars[0]]:
        top = [b + r[key] for b, r in zip(base, bars)]
        ax.stairs(top, edges, baseline=base, fill=True, color=COLOURS[key], alpha=0.85, label=label)
        base = top
    ax.stairs([r["step_ms"] for r in bars], edges, color="black", linewidth=0.6, label="step wall")
    ax.set_xlabel("step" if size == 1 else f"step (mean of every {size} steps)")
    ax.set_ylabel("ms per step")
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(bottom=0)

    rate = ax.twinx()
    throughput = [r["samples"] / (r["step_ms"] / 1e3) if r["step_ms"] > 0 else math.nan for r in bars]
    rate.plot(mids, throughput, color=COLOURS["throughput"], linewidth=1.0, label="throughput")
    rate.set_ylabel("samples/s", color=COLOURS["throughput"])
    rate.set_ylim(bottom=0)

    handles = ax.get_legend_handles_labels()
    more = rate.get_legend_handles_labels()
    fig.legend(handles[0] + more[0], handles[1] + more[1], loc="outside lower center", fontsize="small", ncols=6)
    ax.set_title(title or "per-step time and throughput")
    return _save(fig, path)


def comparison(rows: List[dict], label_keys: Sequence[str], path: Path, title: str = "") -> Path:
    """`comparison_figure` saved at `path`."""
    return _save(comparison_figure(rows, label_keys, title), path)


def comparison_figure(rows: List[dict], label_keys: Sequence[str], title: str = "") -> Figure:
    """Throughput per job (speedup vs its baseline written beside it) and where the wall time went.

    One pair of panels per model, each on its own throughput axis: samples/s of different models
    are not comparable. A speedup within noise is marked `~` and a degraded job (its strategy's
    CPU path) is hatched and named, as in the table (`trainer.tracking.report`)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("model", ""), []).append(r)
    fig = _figure(figsize=(12, 1.2 + 0.45 * max(len(rows), 2) + 0.5 * (len(groups) - 1)), layout="constrained")
    panels = fig.subplots(len(groups), 2, squeeze=False, sharey="row", width_ratios=[3, 2],
                          height_ratios=[max(len(g), 1) for g in groups.values()])
    for (model, group), (left, right) in zip(groups.items(), panels):
        _throughput_panel(left, group, label_keys)
        _time_panel(right, group)
        if len(groups) > 1:
            left.set_title(f"model={model}", loc="left", fontsize="medium")
    panels[-1][0].set_xlabel("throughput (samples/s); ×speedup vs baseline (~: within noise)")
    panels[-1][1].set_xlabel("fraction of timed wall time")
    fig.legend(*panels[0][1].get_legend_handles_labels(), loc="outside lower right", fontsize="small", ncols=2)
    fig.suptitle(title or "sweep comparison")
    return fig


def _value(r: dict, key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) and not math.isnan(v) else 0.0


def _throughput_panel(ax, rows: List[dict], label_keys: Sequence[str]) -> None:
    labels = [" ".join(str(r.get(k, "")) for k in label_keys) or r["run_name"] for r in rows]
    ypos = list(range(len(rows)))[::-1]  # first job on top
    throughput = [_value(r, "throughput_samples_per_s") for r in rows]
    bars = ax.barh(ypos, throughput, color=COLOURS["throughput"])
    span = max(throughput, default=0.0) or 1.0
    for bar, y, r, t in zip(bars, ypos, rows, throughput):
        if r.get("degraded"):
            bar.set(facecolor="#bbbbbb", hatch="//", edgecolor="#555555")
        if r["status"] != "FINISHED":
            note = r["status"]
        else:
            speedup = r.get("speedup_vs_baseline")
            note = f"×{speedup:.2f}{'~' if r.get('speedup_within_noise') else ''}" if isinstance(speedup, float) else ""
            if _value(r, "h2d_GBps") > 0:
                note += f"  {_value(r, 'h2d_GBps'):.1f} GB/s"
            if r.get("degraded"):
                note += "  degraded: CPU path"
        ax.text(t + 0.01 * span, y, note, va="center", fontsize="small",
                color="black" if r["status"] == "FINISHED" else "#d62728")
    ax.set_yticks(ypos, labels)
    ax.set_xlim(0, span * 1.45)


def _time_panel(ax, rows: List[dict]) -> None:
    """Data wait and compute-stream span shares per job (no GPU bar for a job that ran on the CPU)."""
    ypos = list(range(len(rows)))[::-1]
    height = 0.38
    ax.barh([y + height / 2 for y in ypos], [_value(r, "data_wait_fraction") for r in rows], height,
            color=COLOURS["data_wait_ms"], label="data_wait_fraction")
    ax.barh([y - height / 2 for y in ypos], [_value(r, "compute_stream_span_fraction") for r in rows], height,
            color=COLOURS["compute_ms"], label="compute_stream_span_fraction")
    ax.set_xlim(0, 1.05)
