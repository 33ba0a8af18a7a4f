"""dtrain's learning-rate schedules against transformers' own: dtrain.optim writes transformers'
schedule functions out (importing transformers.optimization imports peft and bitsandbytes at every
process start), so every step's learning rate must be theirs exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import get_scheduler

from dtrain.config import OptimConfig
from dtrain.optim import build_scheduler

SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")


def learning_rates(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("warmup,total", [(0, 1), (0, 10), (3, 10), (10, 5), (7, 1000)])
def test_every_step_s_learning_rate_is_transformers_bit_for_bit(schedule, warmup, total):
    """Over the run and past its end (a resumed run with more steps): equal floats, not close ones."""

    def optimizer() -> torch.optim.Optimizer:
        return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)

    settings = OptimConfig(lr=3e-4, schedule=schedule, warmup_steps=warmup)
    ours = learning_rates(build_scheduler(optimizer(), settings, total), total + 3)
    theirs = get_scheduler(schedule, optimizer(), num_warmup_steps=warmup, num_training_steps=total)
    assert ours == learning_rates(theirs, total + 3)
    if schedule in ("linear", "cosine") and total > 1:  # the comparison is not of constants alone
        assert len(set(ours)) > 1


def test_a_scheduler_state_from_transformers_loads():
    """A checkpoint's scheduler state (LambdaLR's) written while dtrain used transformers' schedule
    loads into dtrain's and continues its curve."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    theirs = get_scheduler(
        "cosine", torch.optim.AdamW(params, lr=1.0), num_warmup_steps=2, num_training_steps=9
    )
    learning_rates(theirs, 4)
    ours = build_scheduler(torch.optim.AdamW(params, lr=1.0), OptimConfig(lr=1.0, warmup_steps=2), 9)
    ours.load_state_dict(theirs.state_dict())
    assert learning_rates(ours, 5) == learning_rates(theirs, 5)
