"""GPU probe for `loader=pinned_uva`. Run from the checkout's root:

    python -m benchmarks.uva_probe                 # all three parts, under 2 minutes on an H100
    python -m benchmarks.uva_probe --parts b       # only the bandwidth sweep

Prints one JSON line per measurement (the first names the GPU); a part or variant that fails
prints its error and the probe goes on.
(a) the kernel's gather against `X[idx]`, bit for bit: float32, uint8 and bfloat16 rows, some of
    sizes that are not multiples of 16 bytes, on 1 to 132 blocks;
(b) the gather alone, 64 shuffled rows of 256 KiB from page-locked memory, on 1 to 132 blocks
    (and a few block sizes), against one contiguous pinned copy of the same bytes and against
    one `cudaMemcpyAsync` per row;
(c) short runs through `trainer.loop.run.run`: the reference workload (`experiment=bench_strategies`,
    autoencoder) and only the feed (`experiment=bench_bandwidth`, the same data with model=noop),
    pinned_uva against gpu_resident and pinned_chunk, eager and graphed, then the issue's ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import traceback

import torch

ROW_SHAPE = (256, 256)  # float32: 256 KiB per row, the reference workload's sample
ROWS = 64  # one batch


def emit(**fields) -> None:
    print(json.dumps(fields, default=str), flush=True)


def guarded(part: str, variant: dict, fn) -> None:
    """Run one measurement; on failure print its error as a JSON line and go on."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a probe reports every failure and carries on
        emit(part=part, **variant, error=f"{type(e).__name__}: {e}", where=traceback.format_exc(limit=-3))


def time_ms(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median ms of `fn` on the current stream, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


def pinned_rows(n: int, shape, dtype) -> torch.Tensor:
    x = torch.empty((n, *shape), dtype=dtype, pin_memory=True)
    x.copy_((torch.rand((n, *shape)) * 255).to(dtype))
    return x


# ----------------------------------------------------------------------------- (a)
def part_a() -> None:
    from trainer.loaders.uva_gather import RowGather

    cases = [(torch.float32, (256, 256)), (torch.float32, (5, 7)), (torch.float32, (3, 3)), (torch.uint8, (3, 5)),
             (torch.uint8, (3, 33, 17)), (torch.uint8, (28, 28)), (torch.uint8, (512, 512)), (torch.bfloat16, (3, 3))]
    n = 301
    for dtype, shape in cases:
        x = pinned_rows(n, shape, dtype)
        y = torch.randint(0, 10, (n,))
        for ctas in (1, 4, 32, 132):
            def check(x=x, y=y, dtype=dtype, shape=shape, ctas=ctas):
                gather = RowGather(x, y.cuda(), ctas)
                results = []
                for m in (ROWS, 37, 1):
                    idx = torch.randperm(n)[:m]
                    out = torch.full((ROWS, *shape), 7, dtype=dtype, device="cuda")
                    out_y = torch.full((ROWS,), -1, dtype=torch.int64, device="cuda")
                    gather(idx.cuda(), gather.lanes(out), out_y)
                    torch.cuda.synchronize()
                    results.append(torch.equal(out[:m].cpu(), x[idx]) and torch.equal(out_y[:m].cpu(), y[idx])
                                   and bool((out[m:] == 7).all()) and bool((out_y[m:] == -1).all()))
                emit(part="a", dtype=str(dtype), shape=list(shape), row_bytes=x[0].nbytes, ctas=ctas,
                     lanes=str(gather.dtype), ok=all(results))
            guarded("a", {"dtype": str(dtype), "shape": list(shape), "ctas": ctas}, check)


# ----------------------------------------------------------------------------- (b)
def part_b() -> None:
    from trainer.loaders.uva_gather import BLOCK_BYTES, RowGather

    n = 1000  # the reference dataset: 256 MB pinned
    nbytes = ROWS * 256 * 1024
    x = pinned_rows(n, ROW_SHAPE, torch.float32)
    y = torch.randint(0, 10, (n,)).cuda()
    idx = torch.randperm(n)[:ROWS].cuda()
    out = torch.empty((ROWS, *ROW_SHAPE), device="cuda")
    out_y = torch.empty(ROWS, dtype=torch.int64, device="cuda")

    def gbps(ms: float) -> float:
        return nbytes / (ms * 1e6)

    gather_default = RowGather(x, y, 4)
    target_default = gather_default.lanes(out)
    contiguous = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    flat = out.view(-1).view(torch.uint8)
    rows_host = torch.randperm(n)[:ROWS].tolist()

    def per_row():
        for r, i in enumerate(rows_host):
            out[r].copy_(x[i], non_blocking=True)

    for name, copy in (("contiguous pinned copy", lambda: flat.copy_(contiguous, non_blocking=True)),
                       ("cudaMemcpyAsync per row", per_row)):
        def reference(name=name, copy=copy):
            ms = time_ms(copy)
            emit(part="b", variant=name, ms=ms, GBps=gbps(ms))
        guarded("b", {"variant": name}, reference)

    one = idx[:1]
    for name, launch in (("uva gather launch", lambda: gather_default(one, target_default, out_y)),
                         ("index_select launch (gpu_resident)", lambda: torch.index_select(out, 0, one % ROWS)),
                         ("pinned copy launch (pinned_chunk)", lambda: out[0].copy_(x[0], non_blocking=True))):
        def host_cost(name=name, launch=launch):
            launch()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                launch()
            host_us = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            emit(part="b", variant=name, host_us_per_call=host_us)
        guarded("b", {"variant": name}, host_cost)

    variants = [(c, BLOCK_BYTES, "float32") for c in (1, 2, 4, 8, 16, 32, 132)]
    variants += [(c, b, "float32") for c in (4, 8) for b in (16 << 10, 64 << 10)]
    variants += [(c, BLOCK_BYTES, "uint8") for c in (4, 8, 32)]
    x8 = pinned_rows(n, (512, 512), torch.uint8)  # uint8 rows of the same 256 KiB
    out8 = torch.empty((ROWS, 512, 512), dtype=torch.uint8, device="cuda")
    for ctas, block, dtype in variants:
        def measure(ctas=ctas, block=block, dtype=dtype):
            src, dst = (x, out) if dtype == "float32" else (x8, out8)
            gather = RowGather(src, y, ctas, block_bytes=block)
            target = gather.lanes(dst)
            ms = time_ms(lambda: gather(idx, target, out_y))
            ok = torch.equal(dst.cpu(), src[idx.cpu()])
            emit(part="b", variant="uva gather", dtype=dtype, ctas=ctas, block_bytes=block, ms=ms, GBps=gbps(ms), ok=ok)
        guarded("b", {"variant": "uva gather", "dtype": dtype, "ctas": ctas, "block_bytes": block}, measure)


# ----------------------------------------------------------------------------- (c)
def part_c(steps: int, warmup: int) -> None:
    from hydra import compose, initialize_config_dir

    from trainer.config import CONF_DIR
    from trainer.loop.run import run

    uri = f"sqlite:///{tempfile.mkdtemp(prefix='uva_probe-')}/mlflow.db"
    keys = ("ms_per_step", "host_cpu_ms_per_step", "median_compute_ms", "median_h2d_ms", "h2d_GBps",
            "h2d_peak_pinned_GBps", "h2d_beside_step_fraction", "data_wait_fraction", "setup_s", "peak_gpu_mem_mb",
            "pinned_host_mb")
    jobs = []
    for experiment, model in (("bench_strategies", "autoencoder"), ("bench_bandwidth", "noop")):
        for graphed in ("false", "true"):
            for loader in ("pinned_uva", "gpu_resident", "pinned_chunk"):
                jobs.append((experiment, model, graphed, loader, []))
            if model == "noop" and graphed == "false":  # transfer-bound: more blocks for the gather
                jobs += [(experiment, model, graphed, "pinned_uva", [f"loader.ctas={c}"]) for c in (16, 32)]
    found = {}
    for experiment, model, graphed, loader, extra in jobs:
        overrides = [f"experiment={experiment}", f"loader={loader}", f"engine.cuda_graph={graphed}",
                     f"engine.max_steps={steps}", f"engine.warmup_steps={warmup}", "engine.progress=false",
                     f"tracking.uri={uri}", "engine.device=cuda", *extra]
        variant = {"model": model, "cuda_graph": graphed, "loader": loader, "extra": extra}

        def one(overrides=overrides, variant=variant):
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose("config", overrides=overrides)
            start = time.perf_counter()
            summary = run(cfg)
            row = {k: summary.get(k) for k in keys}
            emit(part="c", **variant, **row, run_s=time.perf_counter() - start)
            found[(variant["model"], variant["cuda_graph"], variant["loader"], tuple(variant["extra"]))] = row
        guarded("c", variant, one)

    def ratio(a: str, b: str, graphed: str, key: str = "ms_per_step"):
        """`key` of loader `a` over loader `b`, autoencoder runs with engine.cuda_graph=`graphed`."""
        try:
            return found[("autoencoder", graphed, a, ())][key] / found[("autoencoder", graphed, b, ())][key]
        except (KeyError, TypeError, ZeroDivisionError):
            return None
    noop = found.get(("noop", "false", "pinned_uva", ()), {})
    emit(part="c", variant="targets",
         graphed_uva_over_gpu_resident=ratio("pinned_uva", "gpu_resident", "true"),  # <= 1.03
         eager_uva_over_pinned_chunk=ratio("pinned_uva", "pinned_chunk", "false"),  # <= 1.05
         host_cpu_uva_over_pinned_chunk=ratio("pinned_uva", "pinned_chunk", "false", "host_cpu_ms_per_step"),  # <= 1
         noop_uva_GBps_over_pinned_peak=(noop["h2d_GBps"] / noop["h2d_peak_pinned_GBps"]  # >= 0.90
                                         if noop.get("h2d_peak_pinned_GBps") else None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="abc", help="which parts to run: any of a, b, c")
    parser.add_argument("--steps", type=int, default=600, help="engine.max_steps of each run of part c")
    parser.add_argument("--warmup", type=int, default=100, help="engine.warmup_steps of each run of part c")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: the probe needs a CUDA device")
    try:
        import triton
        triton_version = triton.__version__
    except ImportError as e:
        triton_version = f"missing ({e})"
    emit(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, triton=triton_version)
    for name, part in (("a", part_a), ("b", part_b), ("c", lambda: part_c(args.steps, args.warmup))):
        if name in args.parts:
            start = time.perf_counter()
            guarded(name, {}, part)
            emit(part=name, elapsed_s=round(time.perf_counter() - start, 1))


if __name__ == "__main__":
    main()
