"""common.runtime.lr_scheduler: the schedules the scripts build on torch's LambdaLR, against hand-worked
multipliers and against transformers' get_scheduler, which they stand in for, to the bit."""

import math

import pytest
import torch
from transformers import get_scheduler

from common.runtime import lr_scheduler


def multipliers(make, name: str, warmup: int, total: int) -> list[float]:
    """The multiplier of the peak rate (1.0) at steps 0..total, as a training loop sees it (step after each update)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler, seen = make(name, optimizer, warmup, total), []
    for _ in range(total + 1):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


@pytest.mark.parametrize("name, warmup, total, expected", [
    ("linear", 2, 6, [0, 0.5, 1, 0.75, 0.5, 0.25, 0]),
    ("linear", 0, 4, [1, 0.75, 0.5, 0.25, 0]),
    ("cosine", 1, 5, [0, 1, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 - math.cos(math.pi / 4)) / 2, 0]),
    ("constant_with_warmup", 2, 4, [0, 0.5, 1, 1, 1]),
    ("constant", 2, 3, [1, 1, 1, 1]),  # a warm-up is ignored, as transformers does
])
def test_schedules_by_hand_and_as_transformers_makes_them(name, warmup, total, expected):
    assert multipliers(lr_scheduler, name, warmup, total) == pytest.approx(expected, abs=1e-12)
    # to the bit: a run's numbers are those it had with transformers' schedule
    assert multipliers(lr_scheduler, name, warmup, total) == multipliers(get_scheduler, name, warmup, total)


def test_other_schedules_are_transformers_own():
    for name in ("polynomial", "inverse_sqrt"):
        assert multipliers(lr_scheduler, name, 2, 7) == pytest.approx(multipliers(get_scheduler, name, 2, 7))
