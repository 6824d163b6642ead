"""Learning rate: linear warm-up from 0, then cosine decay to min_lr_ratio x lr."""

import math


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """`step` counts from 1 (the first optimizer step)."""
    if warmup and step <= warmup:
        return lr * step / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr * (min_ratio + (1 - min_ratio) * cosine)
