"""The training step and its references: the engine's eager step is the step a user writes, the
steps count what they ran, a graphed step's losses stay their steps' while the meter holds them, a
compiled step times its compiling apart and says why it compiled again, the optimizer's
implementation is a lever (`engine.optimizer.impl`), and the hand-written reference loop
(`trainer.tools.plain_loop --step hand`, `trainer.overhead --reference hand`) takes the engine's
steps and does the same math."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clirun import check_turns_run, steps_csv
from conftest import TINY, compose_config
from trainer.config import PROJECT_ROOT, OptimizerConfig
from trainer.errors import ConfigError
from trainer.loop.meter import LOSS_BATCH
from trainer.loop.run import run, warn_compile_timed
from trainer.loop.steps import LOSS_SLOTS, EagerStep, GraphedStep, build_optimizer, make_step
from trainer.tools import plain_loop

gpu = pytest.mark.gpu  # skipped without CUDA (conftest)


class Recording(nn.Module):
    """A linear model that records, at each forward, the gradients zero_grad left for the backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.grads_at_forward = []

    def loss(self, x, y):
        self.grads_at_forward.append([p.grad for p in self.parameters()])
        return F.mse_loss(self.lin(x), y)


def test_the_eager_step_sets_gradients_to_none_as_a_plain_loop_does():
    """`optimizer.zero_grad()` (set_to_none): each backward writes new gradient tensors; the
    old ones are neither zeroed nor added into."""
    torch.manual_seed(0)
    model = Recording()
    step = EagerStep(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    step(x, y)
    first = [p.grad for p in model.parameters()]
    kept = [g.clone() for g in first]
    step(x * 2, y)
    assert all(g is None for g in model.grads_at_forward[1])  # no gradient buffer while the step runs
    assert all(p.grad is not g for p, g in zip(model.parameters(), first))  # fresh tensors
    assert all(torch.equal(g, k) for g, k in zip(first, kept))  # the first step's are untouched


def test_steps_count_graph_replays_and_eager_steps():
    model = Recording()
    step = make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), graphed=False)
    for _ in range(3):
        step(torch.randn(8, 4), torch.randn(8, 2))
    assert isinstance(step, EagerStep) and (step.graph_replays, step.eager_steps) == (0, 3)
    graphed = GraphedStep(model, None)
    assert (graphed.graph_replays, graphed.eager_steps) == (0, 0)  # before its first step


def test_a_graphed_loss_is_its_steps_for_longer_than_the_meter_holds_it():
    assert LOSS_SLOTS > LOSS_BATCH


def test_a_run_records_what_its_step_ran(tiny_cfg, runs):
    summary = run(tiny_cfg("engine.max_steps=7"))
    assert (summary["graph_replays"], summary["eager_steps"], summary["total_steps"]) == (0, 7, 7)
    (r,) = runs()
    assert (r.data.metrics["graph_replays"], r.data.metrics["eager_steps"]) == (0, 7)


@gpu
def test_the_graphed_step_counts_its_replays_and_trains_like_the_eager_one():
    """71 steps of 8 samples and a last one of 3: 71 replays, 1 eager step. The losses, held and
    stacked 32 at a time as the meter does, are the eager step's from the same weights."""
    def build():
        torch.manual_seed(0)
        model = Recording().cuda()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)

    gen = torch.Generator(device="cuda").manual_seed(1)
    batches = [(torch.randn(8, 4, device="cuda", generator=gen), torch.randn(8, 2, device="cuda", generator=gen))
               for _ in range(71)]
    batches.append((torch.randn(3, 4, device="cuda", generator=gen), torch.randn(3, 2, device="cuda", generator=gen)))
    eager = EagerStep(*build())
    expected = torch.stack([eager(x, y).detach() for x, y in batches])
    graphed = GraphedStep(*build())
    logged, held = [], []
    for x, y in batches:
        held.append(graphed(x, y).detach())
        if len(held) == LOSS_BATCH:
            logged.append(torch.stack(held))
            held = []
    logged.append(torch.stack(held))
    assert (graphed.graph_replays, graphed.eager_steps) == (71, 1)
    torch.testing.assert_close(torch.cat(logged), expected, rtol=1e-4, atol=1e-6)


@gpu
def test_a_graph_captured_by_hand_replays_only_whole_batches(tiny_cfg):
    """100 samples in batches of 16: the 7th batch (4 samples) cannot replay a hand-captured graph."""
    graphed = ["engine.device=cuda", "engine.cuda_graph=true", "engine.max_steps=20", "engine.warmup_steps=4",
               "dataset.num_samples=100"]
    with pytest.raises(ConfigError, match=r"step 7 has 4 samples.*set loader.drop_last=true"):
        plain_loop.measure(tiny_cfg(*graphed), step="hand")
    assert plain_loop.measure(tiny_cfg(*graphed, "loader.drop_last=true"), step="hand")["plain_timed_steps"] == 16


# ------------------------------------------------------------------- torch.compile
def test_a_compiled_run_times_its_compile_apart_trains_as_the_eager_one_and_names_its_recompile(
        tiny_cfg, runs, tracking_uri, capsys):
    """The one test that compiles (inductor on the CPU, 10-30 s): 100 samples in batches of 16 end
    each epoch with a batch of 4, compiled again once (its code is kept for the second epoch). The
    compile's seconds and the recompile are in the summary and in MLflow, the cause is named with
    its fix, and the losses are the eager step's from the same seed."""
    common = ["dataset.num_samples=100", "engine.epochs=2", "loader.shuffle=true"]
    eager = run(tiny_cfg(*common))
    capsys.readouterr()
    compiled = run(tiny_cfg(*common, "engine.compile=default"))
    err = capsys.readouterr().err
    assert compiled["compile_s"] > 0 and compiled["compile_recompiles"] == 1 and "compile_s" not in eager
    assert (compiled["graph_replays"], compiled["eager_steps"], compiled["total_steps"]) == (0, 0, 14)
    assert re.search(r"^warning: engine\.compile=default compiled the step 1 more time\(s\) after its first step "
                     r"\(compile_recompiles=1, within compile_s=[\d.]+\), first for a batch of 4 samples, not 16 "
                     r"\(a partial last batch\): set loader\.drop_last=true$", err, re.M)
    assert re.search(r"on cpu, torch\.compile mode default \([\d.]+ s compiling, 1 recompiles\)", err)
    r, r_eager = runs()  # newest first
    assert r.data.metrics["compile_s"] == pytest.approx(compiled["compile_s"])
    assert r.data.metrics["compile_recompiles"] == 1 and r.data.tags["compile"] == "default"
    losses = [[float(row["loss"]) for row in steps_csv(tracking_uri, run.info.run_id)] for run in (r, r_eager)]
    assert len(losses[0]) == 14 and len(set(losses[0])) > 1
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


def test_a_warm_up_shorter_than_the_compile_is_said_in_one_line(capsys):
    warn_compile_timed("default", 0, graphs=False)
    warn_compile_timed("reduce-overhead", 1, graphs=True)
    warn_compile_timed("reduce-overhead", 1, graphs=False)  # no CUDA graphs on the CPU: compiled at the first step only
    warn_compile_timed("off", 0, graphs=True)
    assert capsys.readouterr().err.splitlines() == [
        "warning: engine.compile=default compiles the step at the first step, and engine.warmup_steps=0 leaves that "
        "in the timed steps (compile_s says how long it took): set engine.warmup_steps=5",
        "warning: engine.compile=reduce-overhead compiles the step at the first step and records its CUDA graphs at "
        "the second, and engine.warmup_steps=1 leaves that in the timed steps (compile_s says how long it took): set "
        "engine.warmup_steps=5"]


@gpu
def test_reduce_overhead_keeps_each_steps_loss_and_trains_as_the_eager_step(tiny_cfg, runs, tracking_uri):
    """torch's CUDA graphs overwrite their outputs at the next replay: the losses the meter held
    for 32 steps are still each step's own, the eager step's from the same seed."""
    common = ["engine.device=cuda", "dataset.num_samples=160", "engine.epochs=3", "loader.shuffle=true",
              "loader.drop_last=true", "engine.warmup_steps=3"]
    run(tiny_cfg(*common))
    compiled = run(tiny_cfg(*common, "engine.compile=reduce-overhead", "engine.optimizer.impl=fused"))
    assert compiled["compile_s"] > 0 and compiled["compile_recompiles"] == 0
    r, r_eager = runs()
    losses = [[float(row["loss"]) for row in steps_csv(tracking_uri, run.info.run_id)] for run in (r, r_eager)]
    assert len(losses[0]) == 30 and len(set(losses[0])) == 30
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)


# ------------------------------------------------------------------- the optimizer's implementation
class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2, dtype=torch.complex64))


@pytest.mark.parametrize("impl,kwargs", [("default", {"foreach": None, "fused": None}),
                                         ("for-loop", {"foreach": False, "fused": None}),
                                         ("foreach", {"foreach": True, "fused": None}),
                                         ("fused", {"foreach": None, "fused": True})])
def test_the_optimizer_implementation_is_torchs_and_each_one_makes_the_same_update(impl, kwargs):
    """Same weights and gradients, three steps: every implementation lands on the for-loop's
    weights (to float rounding), for each optimizer."""
    for name in ("adam", "adamw", "sgd"):
        weights = []
        for chosen in ("for-loop", impl):
            torch.manual_seed(0)
            model = nn.Linear(6, 3)
            optimizer = build_optimizer(OptimizerConfig(name=name, lr=0.1, impl=chosen), model)
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.ones(4, 6)).square().mean().backward()
                optimizer.step()
            weights.append(model.weight.detach())
        assert {k: optimizer.defaults[k] for k in kwargs} == kwargs  # the last one built: `impl`'s
        torch.testing.assert_close(weights[1], weights[0])


def test_fused_refuses_parameters_without_a_fused_kernel_before_the_run():
    with pytest.raises(ConfigError, match=r"^engine\.optimizer\.impl=fused needs floating-point parameters on cpu or "
                                          r"cuda \(a parameter is torch\.complex64 on cpu\): set engine\.optimizer\.impl=foreach$"):
        build_optimizer(OptimizerConfig(impl="fused"), Complex())


@gpu
def test_a_graphed_step_with_the_fused_optimizer_trains_as_the_eager_one():
    """The fused kernels keep Adam's step count on the device: captured (with capturable=True, as
    the engine builds it for a graph), they update as the eager step does."""
    losses = {}
    for graphed in (False, True):
        torch.manual_seed(0)
        model = Recording().cuda()
        optimizer = build_optimizer(OptimizerConfig(impl="fused", lr=1e-2), model, capturable=graphed)
        step = make_step(model, optimizer, graphed)
        gen = torch.Generator(device="cuda").manual_seed(1)
        losses[graphed] = torch.stack([step(torch.randn(8, 4, device="cuda", generator=gen),
                                            torch.randn(8, 2, device="cuda", generator=gen)).detach().clone()
                                       for _ in range(10)])
        assert step.graph_replays == 10 * graphed
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------- the hand-written reference
HAND = [*TINY, "engine.max_steps=20", "engine.warmup_steps=4"]


def test_the_hand_reference_takes_the_engines_steps_and_prints_its_figures():
    proc = subprocess.run([sys.executable, "-m", "trainer.tools.plain_loop", "--step", "hand", *HAND],
                          capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["plain_timed_steps"] == 16 == plain_loop.measure(compose_config(*HAND))["plain_timed_steps"]
    assert figures["plain_ms_per_step"] > 0 and figures["plain_host_cpu_ms_per_step"] > 0
    assert figures["plain_host_page_faults_per_step"] >= 0


def test_without_warm_up_the_plain_loops_time_every_step():
    for step in ("engine", "hand"):
        assert plain_loop.measure(compose_config(*TINY, "engine.max_steps=5", "engine.warmup_steps=0"),
                                  step=step)["plain_timed_steps"] == 5


def test_the_hand_reference_does_the_engine_steps_math(monkeypatch):
    """Same seed, same batches: the hand-written loop's losses are the engine's eager step's, bit for bit."""
    losses, build_model = [], plain_loop.build_model

    def recording_model(*args):
        model = build_model(*args)
        forward = model.loss

        def loss(x, y):
            out = forward(x, y)
            losses[-1].append(out.detach().clone())
            return out
        model.loss = loss
        return model

    monkeypatch.setattr(plain_loop, "build_model", recording_model)
    got = {}
    for step in ("engine", "hand"):
        losses.append([])
        plain_loop.measure(compose_config(*HAND, "loader.shuffle=true"), step=step)
        got[step] = torch.stack(losses[-1])
    assert len(got["hand"]) == len(got["engine"]) == 20
    assert torch.equal(got["hand"], got["engine"]) and len(set(got["hand"].tolist())) > 1


def test_the_hand_reference_needs_a_model_with_parameters():
    with pytest.raises(ConfigError, match=r"model=noop.*--step engine"):
        plain_loop.measure(compose_config(*HAND, "model=noop"), step="hand")


def test_the_hand_reference_runs_eagerly_and_says_so_for_a_compiled_run():
    with pytest.raises(ConfigError, match=r"^the hand-written step runs eagerly \(got engine\.compile=default\): use the "
                                          r"engine's step \(--step engine\), which compiles as the run did$"):
        plain_loop.measure(compose_config(*HAND, "engine.compile=default"), step="hand")


@pytest.mark.slow  # the overhead tool's other cases run by default; this one with `-m slow`
def test_overhead_tool_takes_turns_with_the_hand_written_reference(tmp_path, capsys):
    """`python -m trainer.overhead --reference hand`: the CLI against the loop a user writes, in
    turns; the table names the reference."""
    from trainer.overhead import main
    table = tmp_path / "overhead.md"
    main(["--reference", "hand", "--repeats", "1", "--turn-ms", "20", "--settle-ms", "2", "--markdown", str(table),
          "engine.device=cpu", "dataset.num_samples=96", "dataset.shape=[8,8]", "loader.batch_size=16",
          "engine.max_steps=3000", "engine.warmup_steps=10"])
    out = capsys.readouterr().out
    got, cells = check_turns_run(out, table, "`baseline`", max_steps=3000)
    assert "reference=hand" in out and " hand " in [line for line in out.splitlines() if "repeat 1:" in line][0]
    assert cells[1:4] == ["no", "turns", "hand-written step"]
    assert float(cells[4]) == pytest.approx(got["first"], abs=1e-3)
    assert float(cells[5]) == pytest.approx(got["second"], abs=1e-3)


@gpu
def test_graph_floor_times_every_variant():
    """benchmarks/graph_floor.py, shortened: one JSON line per variant, each read against its hand-written kind."""
    proc = subprocess.run([sys.executable, "benchmarks/graph_floor.py", "--steps", "20", "--blocks", "2", "--warmup", "5"],
                          capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["variant"] for r in lines] == ["hand_graph", "graphed_step_before", "graphed_step", "graphed_step_events",
                                            "eager_step", "hand_eager"]
    assert all(r["median_ms_per_step"] > 0 and r["gpu"] == torch.cuda.get_device_name() for r in lines)
    assert lines[0]["vs_hand_graph"] == 1.0 and lines[-1]["vs_hand_eager"] == 1.0
