"""The training step and its references: the engine's eager step is the step a user writes, both
steps count what they ran, a graphed step's losses stay their steps' while the meter holds them,
and the hand-written reference loop (`trainer.tools.plain_loop --step hand`, `trainer.overhead
--reference hand`) takes the engine's steps and does the same math."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clirun import check_turns_run
from conftest import TINY, compose_config
from trainer.config import PROJECT_ROOT
from trainer.errors import ConfigError
from trainer.loop.meter import LOSS_BATCH
from trainer.loop.run import run
from trainer.loop.steps import LOSS_SLOTS, EagerStep, GraphedStep, make_step
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
