"""The training step: the engine's eager step is the step a user writes, both steps count what
they ran, and a graphed step's losses stay their steps' while the meter holds them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from trainer.loop.meter import LOSS_BATCH
from trainer.loop.run import run
from trainer.loop.steps import LOSS_SLOTS, EagerStep, GraphedStep, make_step

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
