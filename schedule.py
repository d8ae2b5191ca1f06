"""The learning rate at each optimizer step: a linear warmup, then cosine, linear or constant.

Copyable on its own: imports only the standard library. This runs as written:

    from schedule import ScheduleConfig, learning_rate

    total = 10  # optimizer steps in the run
    config = ScheduleConfig(warmup_steps=2)  # then cosine, to a tenth of lr at the last step
    lrs = [learning_rate(step, 1e-6, config, total) for step in range(total)]  # step: 0-based
    print(" ".join(f"{lr:.2e}" for lr in lrs))
    linear = ScheduleConfig(warmup_ratio=0.1, lr_schedule="linear")  # TRL's: 1 warmup step here
    print(" ".join(f"{learning_rate(step, 1e-6, linear, total):.2e}" for step in range(total)))
"""

import math
from dataclasses import dataclass
from typing import Literal


@dataclass
class ScheduleConfig:
    warmup_steps: int = 10
    """Linear warmup steps, then the --lr-schedule."""
    warmup_ratio: float = 0.0
    """Warmup as a share of all steps (TRL's warmup_ratio); above 0 it replaces --warmup-steps."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After warmup: cosine to a tenth of --lr at the last step (kept low, not 0, so the last steps
    still learn), linear to 0 (TRL's default), or constant."""

    def __post_init__(self):
        if self.warmup_steps < 0 or not 0 <= self.warmup_ratio < 1:
            raise ValueError("--warmup-steps must be >= 0, --warmup-ratio in [0, 1)")


def learning_rate(step: int, lr: float, config: ScheduleConfig, total: int) -> float:
    """Step `step`'s (0-based, of `total`) learning rate: a linear warmup to `lr`, then
    config.lr_schedule."""
    warmup = math.ceil(config.warmup_ratio * total) if config.warmup_ratio else config.warmup_steps
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return lr
    if config.lr_schedule == "linear":
        # As transformers' linear schedule: it would reach 0 one step after the last.
        return lr * (total - step) / (total - warmup)
    progress = min((step - warmup) / max(total - 1 - warmup, 1), 1.0)
    return lr / 10 + (lr - lr / 10) * 0.5 * (1 + math.cos(math.pi * progress))
